// Bindings for the memory-bound layer kernels: embedding, RMSNorm, SiLU-and-mul, argmax and
// sample_rows.
#include <climits>
#include <vector>

#include "../csrc/activation.h"
#include "../csrc/embedding.h"
#include "../csrc/norm.h"
#include "../csrc/sampling.h"
#include "tensor.h"

namespace nanograph::py_ext {

namespace {

int checked_int(int64_t value, const std::string& what) {
  if (value > INT_MAX) {
    throw_invalid_argument(what + " is " + std::to_string(value) + "; the kernels take at most " +
                          std::to_string(INT_MAX) + " (split the batch)");
  }
  return static_cast<int>(value);
}

// Rows of a tensor viewed as [rows, size(-1)].
int leading_rows(const Tensor& t) {
  if (t.dim() == 0) throw_invalid_argument(t.name + " must have at least one dimension");
  return checked_int(t.size(-1) == 0 ? 0 : t.numel() / t.size(-1), t.name + "'s row count");
}

std::vector<int64_t> with_last(std::vector<int64_t> shape, int64_t last) {
  shape.back() = last;
  return shape;
}

// logits may be a row slice of a wider buffer ([rows, vocab] out of [rows, padded]): only the
// last dimension must be contiguous. Returns the tensor and its row stride in elements.
std::pair<Tensor, int64_t> row_strided_logits(py::object logits, const char* dtype = "bfloat16") {
  const auto stride = logits.attr("stride")().cast<std::vector<int64_t>>();
  if (stride.size() != 2) {
    throw_invalid_argument("logits must be 2-D [rows, vocab], got " + std::to_string(stride.size()) +
                          " dimensions");
  }
  const auto shape = logits.attr("shape").cast<std::vector<int64_t>>();
  if (shape[0] > 1 && (stride[1] != 1 || stride[0] < shape[1])) {
    throw_invalid_argument("logits must have unit stride along vocab and rows that do not overlap, "
                          "got strides (" + std::to_string(stride[0]) + ", " +
                          std::to_string(stride[1]) + "); call .contiguous()");
  }
  // One row is contiguous, so it passes the usual device/dtype/contiguity checks.
  py::object first_row = shape[0] > 0 ? logits.attr("narrow")(0, 0, 1) : logits;
  Tensor t = cuda_tensor(first_row, "logits", dtype);
  t.shape = shape;
  return {t, shape[0] > 1 ? stride[0] : shape[1]};
}

}  // namespace

NANOGRAPH_BINDINGS(bind_basic) {
  m.def(
      "embedding",
      [](py::object ids, py::object table, py::object out) {
        Tensor ti = cuda_tensor(ids, "ids", "int32");
        Tensor tt = cuda_tensor(table, "table", "bfloat16");
        Tensor to = cuda_tensor(out, "out", "bfloat16");
        expect_shape(ti, {-1});
        expect_shape(tt, {-1, -1});
        expect_shape(to, {ti.size(0), tt.size(1)});
        same_device({&ti, &tt, &to});
        embedding(ti.data<int32_t>(), tt.data<bf16>(), to.data<bf16>(),
                  checked_int(ti.size(0), "number of tokens"), checked_int(tt.size(1), "hidden"),
                  checked_int(tt.size(0), "vocab"), torch_current_stream());
      },
      py::arg("ids"), py::arg("table"), py::arg("out"),
      "out[t] = table[ids[t]]; ids [n] int32, table [vocab, hidden] bf16, out [n, hidden] bf16. "
      "Ids outside [0, vocab) give zero rows.");

  m.def(
      "rmsnorm",
      [](py::object x, py::object weight, py::object out, float eps) {
        Tensor tx = cuda_tensor(x, "x", "bfloat16");
        Tensor tw = cuda_tensor(weight, "weight", "bfloat16");
        Tensor to = cuda_tensor(out, "out", "bfloat16");
        const int rows = leading_rows(tx);
        expect_shape(tw, {tx.size(-1)});
        expect_shape(to, tx.shape);
        same_device({&tx, &tw, &to});
        rmsnorm(tx.data<bf16>(), tw.data<bf16>(), to.data<bf16>(), rows,
                checked_int(tx.size(-1), "hidden"), eps, torch_current_stream());
      },
      py::arg("x"), py::arg("weight"), py::arg("out"), py::arg("eps"),
      "out = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * weight) over the last dimension; "
      "x, out [..., hidden] bf16, weight [hidden] bf16.");

  m.def(
      "add_rmsnorm",
      [](py::object x, py::object residual, py::object weight, float eps) {
        Tensor tx = cuda_tensor(x, "x", "bfloat16");
        Tensor tr = cuda_tensor(residual, "residual", "bfloat16");
        Tensor tw = cuda_tensor(weight, "weight", "bfloat16");
        const int rows = leading_rows(tx);
        expect_shape(tr, tx.shape);
        expect_shape(tw, {tx.size(-1)});
        same_device({&tx, &tr, &tw});
        add_rmsnorm(tx.data<bf16>(), tr.data<bf16>(), tw.data<bf16>(), rows,
                    checked_int(tx.size(-1), "hidden"), eps, torch_current_stream());
      },
      py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
      "In place: residual = bf16(x + residual); x = rmsnorm(residual) * weight. "
      "x, residual [..., hidden] bf16, weight [hidden] bf16.");

  m.def(
      "silu_mul",
      [](py::object gate_up, py::object out) {
        Tensor tg = cuda_tensor(gate_up, "gate_up", "bfloat16");
        Tensor to = cuda_tensor(out, "out", "bfloat16");
        const int rows = leading_rows(tg);
        if (tg.size(-1) % 2 != 0) {
          throw_invalid_argument("gate_up's last dimension must be 2 * inter (gate then up), got " +
                                std::to_string(tg.size(-1)));
        }
        expect_shape(to, with_last(tg.shape, tg.size(-1) / 2));
        same_device({&tg, &to});
        silu_mul(tg.data<bf16>(), to.data<bf16>(), rows, checked_int(tg.size(-1) / 2, "inter"),
                 torch_current_stream());
      },
      py::arg("gate_up"), py::arg("out"),
      "out = silu(gate) * up, gate_up [..., 2 * inter] bf16 (gate first), out [..., inter] bf16.");

  m.def(
      "argmax",
      [](py::object logits, py::object out) {
        auto [tl, row_stride] = row_strided_logits(logits);
        Tensor to = cuda_tensor(out, "out", "int32");
        expect_shape(to, {tl.size(0)});
        same_device({&tl, &to});
        argmax(tl.data<bf16>(), checked_int(tl.size(0), "rows"), checked_int(tl.size(1), "vocab"),
               checked_int(row_stride, "logits' row stride"), to.data<int32_t>(),
               torch_current_stream());
      },
      py::arg("logits"), py::arg("out"),
      "out[r] = argmax(logits[r]) with ties to the lowest index, like torch.argmax; logits "
      "[rows, vocab] bf16 (rows may be strided, vocab must be contiguous), out [rows] int32.");

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
