// Bindings for the sampling kernels (csrc/sampling.h): sample_rows and prepare_overrides, each
// from separate tensors.
#include <string>
#include <vector>

#include "../csrc/sampling.h"
#include "tensor.h"

namespace nanograph::py_ext {

NANOGRAPH_BINDINGS(bind_sampling) {
  m.def(
      "sample_rows",
      [](py::object logits, py::object temperatures, py::object top_ks, py::object top_ps,
         py::object min_ps, py::object keys, py::object out, py::object thresholds,
         py::object overrides, py::object override_rows, py::object num_logprobs,
         py::object logprobs, py::object logprob_ids) {
        const bool bf16_logits = py::str(logits.attr("dtype")).cast<std::string>() == "torch.bfloat16";
        auto [tl, row_stride] = row_strided_logits(logits, bf16_logits ? "bfloat16" : "float32");
        const int64_t rows = tl.size(0);
        Tensor tt = cuda_tensor(temperatures, "temperatures", "float32");
        Tensor tk = cuda_tensor(top_ks, "top_ks", "int32");
        Tensor tp = cuda_tensor(top_ps, "top_ps", "float32");
        Tensor tm = cuda_tensor(min_ps, "min_ps", "float32");
        Tensor tkeys = cuda_tensor(keys, "keys", "int64");
        Tensor to = cuda_tensor(out, "out", "int64");
        Tensor tth = optional_cuda_tensor(thresholds, "thresholds", "float32");
        Tensor tov = optional_cuda_tensor(overrides, "overrides", "float32");
        Tensor tor = optional_cuda_tensor(override_rows, "override_rows", "int32");
        for (const Tensor* t : {&tt, &tk, &tp, &tm, &tkeys, &to}) expect_shape(*t, {rows});
        std::vector<const Tensor*> all = {&tl, &tt, &tk, &tp, &tm, &tkeys, &to};
        if (tth.ptr) expect_shape(tth, {rows}), all.push_back(&tth);
        if ((tov.ptr == nullptr) != (tor.ptr == nullptr)) {
          throw_invalid_argument("overrides and override_rows go together: pass both or neither");
        }
        if (tov.ptr) {
          expect_shape(tov, {-1, tl.size(1)});
          expect_shape(tor, {rows});
          all.push_back(&tov);
          all.push_back(&tor);
        }
        Tensor tn = optional_cuda_tensor(num_logprobs, "num_logprobs", "int32");
        Tensor tlp = optional_cuda_tensor(logprobs, "logprobs", "float32");
        Tensor tli = optional_cuda_tensor(logprob_ids, "logprob_ids", "int64");
        if (tn.ptr) {
          if (!tlp.ptr || !tli.ptr) {
            throw_invalid_argument("num_logprobs needs logprobs and logprob_ids [rows, 1 + n]");
          }
          expect_shape(tn, {rows});
          expect_shape(tlp, {rows, -1});
          expect_shape(tli, tlp.shape);
          if (tlp.size(1) < 1 || tlp.size(1) > 1 + kMaxTopLogprobs) {
            throw_invalid_argument("logprobs has " + std::to_string(tlp.size(1)) +
                                  " columns; it takes 1 + n with n <= " +
                                  std::to_string(kMaxTopLogprobs) + " (the sampled token's, then the top n)");
          }
          all.insert(all.end(), {&tn, &tlp, &tli});
        }
        same_device(all);
        SampleRowsArgs args;
        args.logits = tl.ptr;
        args.logits_bf16 = bf16_logits;
        args.logits_stride = row_stride;
        args.overrides = tov.data<float>();
        args.overrides_stride = tov.ptr ? tov.size(1) : 0;
        args.override_rows = tor.data<int32_t>();
        args.rows = checked_int(rows, "rows");
        args.vocab = checked_int(tl.size(1), "vocab");
        args.temperatures = tt.data<float>();
        args.top_ks = tk.data<int32_t>();
        args.top_ps = tp.data<float>();
        args.min_ps = tm.data<float>();
        args.keys = tkeys.data<uint64_t>();
        args.out = to.data<int64_t>();
        args.thresholds = tth.data<float>();
        args.num_logprobs = tn.data<int32_t>();
        args.logprob_width = tn.ptr ? static_cast<int>(tlp.size(1)) - 1 : 0;
        args.logprobs = tlp.data<float>();
        args.logprob_ids = tli.data<int64_t>();
        sample_rows(args, torch_current_stream());
      },
      py::arg("logits"), py::arg("temperatures"), py::arg("top_ks"), py::arg("top_ps"),
      py::arg("min_ps"), py::arg("keys"), py::arg("out"), py::arg("thresholds") = py::none(),
      py::arg("overrides") = py::none(), py::arg("override_rows") = py::none(),
      py::arg("num_logprobs") = py::none(), py::arg("logprobs") = py::none(),
      py::arg("logprob_ids") = py::none(),
      "One token per row into out [rows] int64, from logits [rows, vocab] bf16 or float32 (rows "
      "may be strided): temperature (0: greedy), top_k (<= 0 or >= vocab: none), top_p, min_p "
      "([rows] float32 / int32), and keys [rows] int64, each row's random key (see "
      "csrc/sampling.h). thresholds [rows] float32, optional, receives the smallest logit / "
      "temperature a row may draw. overrides [n, vocab] float32 with override_rows [rows] int32: "
      "row r reads overrides[override_rows[r]] instead of logits[r] where that is >= 0. "
      "num_logprobs [rows] int32 (-1: none, else n top logprobs) with logprobs [rows, 1 + n_max] "
      "float32 and logprob_ids [rows, 1 + n_max] int64: the sampled token's logprob of the raw "
      "logits and its rank (tokens strictly more likely), then the top n's logprobs and ids.");

  m.def(
      "prepare_overrides",
      [](py::object logits, py::object source_rows, py::object overrides, py::object seen_tokens,
         py::object output_counts, py::object presence, py::object frequency,
         py::object repetition, py::object masked_tokens) {
        const bool bf16_logits = py::str(logits.attr("dtype")).cast<std::string>() == "torch.bfloat16";
        auto [tl, row_stride] = row_strided_logits(logits, bf16_logits ? "bfloat16" : "float32");
        Tensor ts = cuda_tensor(source_rows, "source_rows", "int32");
        Tensor to = cuda_tensor(overrides, "overrides", "float32");
        Tensor tt = cuda_tensor(seen_tokens, "seen_tokens", "int32");
        Tensor tc = cuda_tensor(output_counts, "output_counts", "int32");
        Tensor tp = cuda_tensor(presence, "presence", "float32");
        Tensor tf = cuda_tensor(frequency, "frequency", "float32");
        Tensor tr = cuda_tensor(repetition, "repetition", "float32");
        Tensor tm = cuda_tensor(masked_tokens, "masked_tokens", "int32");
        const int64_t n = ts.size(0);
        expect_shape(ts, {-1});
        expect_shape(to, {n, tl.size(1)});
        expect_shape(tt, {n, -1});
        expect_shape(tc, tt.shape);
        for (const Tensor* t : {&tp, &tf, &tr}) expect_shape(*t, {n});
        expect_shape(tm, {n, -1});
        same_device({&tl, &ts, &to, &tt, &tc, &tp, &tf, &tr, &tm});
        OverrideArgs args;
        args.logits = tl.ptr;
        args.logits_bf16 = bf16_logits;
        args.logits_stride = row_stride;
        args.vocab = checked_int(tl.size(1), "vocab");
        args.num_rows = checked_int(n, "rows");
        args.source_rows = ts.data<int32_t>();
        args.overrides = to.data<float>();
        args.num_seen = checked_int(tt.size(1), "seen tokens per row");
        args.seen_tokens = tt.data<int32_t>();
        args.output_counts = tc.data<int32_t>();
        args.presence = tp.data<float>();
        args.frequency = tf.data<float>();
        args.repetition = tr.data<float>();
        args.num_masked = checked_int(tm.size(1), "masked tokens per row");
        args.masked_tokens = tm.data<int32_t>();
        prepare_overrides(args, torch_current_stream());
      },
      py::arg("logits"), py::arg("source_rows"), py::arg("overrides"), py::arg("seen_tokens"),
      py::arg("output_counts"), py::arg("presence"), py::arg("frequency"), py::arg("repetition"),
      py::arg("masked_tokens"),
      "overrides [n, vocab] float32 = logits[source_rows] (bf16 or float32; source_rows [n] int32), "
      "then vLLM's penalties at each row's seen tokens (seen_tokens [n, m] int32, unique per row, "
      "-1 padding; output_counts [n, m] int32, their occurrences in the output; presence, "
      "frequency, repetition [n] float32), then -inf at masked_tokens [n, k] int32 (-1 padding).");
}

}  // namespace nanograph::py_ext
