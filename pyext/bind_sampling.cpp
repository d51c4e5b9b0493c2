// Bindings for the sampling kernels (csrc/sampling.h): sample_rows and prepare_overrides, each
// from separate tensors, and sample_packed, which runs both from two blobs: the parameters, one
// uint8 tensor the host fills and sends in one copy, and the results, one uint8 tensor read back
// in one copy (python/nanograph/packed_sampling.py writes the layout). Checking two blobs and a
// tuple of offsets costs the host far less than reading some twenty tensors' attributes.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "../csrc/sampling.h"
#include "tensor.h"

namespace nanograph::py_ext {

namespace {

// sample_packed's layout: the counts, then each field's byte offset in its blob (the parameters'
// from temperatures to masked_tokens, then the results'). n = num_overrides.
struct PackedLayout {
  int64_t rows, logprob_columns, num_overrides, seen_width, masked_width;
  int64_t temperatures, top_ks, top_ps, min_ps, keys, num_logprobs;  // [rows]
  int64_t override_rows;                                             // [rows]
  int64_t override_source, seen_tokens, output_counts;  // [n], [n, seen_width] x 2
  int64_t presence, frequency, repetition;              // [n]
  int64_t masked_tokens;                                // [n, masked_width]
  int64_t token_ids, logprobs, logprob_ids;  // results: [rows], [rows, logprob_columns] x 2
};
constexpr size_t kLayoutSize = sizeof(PackedLayout) / sizeof(int64_t);
constexpr int64_t kFieldAlignment = 16;

PackedLayout read_layout(const std::vector<int64_t>& values) {
  if (values.size() != kLayoutSize) {
    throw_invalid_argument("layout has " + std::to_string(values.size()) + " values; it takes " +
                          std::to_string(kLayoutSize) + " (5 counts, then 17 offsets: see "
                          "python/nanograph/packed_sampling.py)");
  }
  PackedLayout layout;
  std::memcpy(&layout, values.data(), sizeof layout);
  const std::pair<const char*, int64_t> counts[] = {
      {"rows", layout.rows}, {"logprob_columns", layout.logprob_columns},
      {"num_overrides", layout.num_overrides}, {"seen_width", layout.seen_width},
      {"masked_width", layout.masked_width}};
  for (const auto& [name, count] : counts) {
    if (count < 0) throw_invalid_argument(std::string("layout's ") + name + " is negative");
    checked_int(count, std::string("layout's ") + name);
  }
  if (layout.logprob_columns > 1 + kMaxTopLogprobs) {
    throw_invalid_argument("layout has " + std::to_string(layout.logprob_columns) +
                          " logprob columns; the kernel takes at most 1 + " +
                          std::to_string(kMaxTopLogprobs));
  }
  return layout;
}

// A uint8 tensor holding fields at byte offsets. field() checks that each lies inside it, at an
// aligned offset; disjoint() that no two non-empty ones overlap.
class Blob {
 public:
  Blob(py::handle obj, const char* name) : tensor_(cuda_tensor(obj, name, "uint8")) {
    expect_shape(tensor_, {-1});
    if (reinterpret_cast<uintptr_t>(tensor_.ptr) % kFieldAlignment != 0) {
      throw_invalid_argument(tensor_.name + " must start at a " + std::to_string(kFieldAlignment) +
                            "-byte boundary (a fresh tensor does)");
    }
  }

  const Tensor& tensor() const { return tensor_; }

  template <class T>
  T* field(const char* name, int64_t offset, int64_t count) {
    const int64_t size = tensor_.size(0);
    if (offset < 0 || offset % kFieldAlignment != 0 || offset > size ||
        count > (size - offset) / static_cast<int64_t>(sizeof(T))) {
      throw_invalid_argument(std::string(name) + " (" + std::to_string(count) + " x " +
                            std::to_string(sizeof(T)) + " bytes at offset " +
                            std::to_string(offset) + ") must lie inside " + tensor_.name + " (" +
                            std::to_string(size) + " bytes) at a multiple of " +
                            std::to_string(kFieldAlignment));
    }
    const int64_t end = offset + count * static_cast<int64_t>(sizeof(T));
    if (end > offset) spans_.push_back({offset, end, name});
    return reinterpret_cast<T*>(static_cast<char*>(tensor_.ptr) + offset);
  }

  void disjoint() {
    std::sort(spans_.begin(), spans_.end(),
              [](const Span& a, const Span& b) { return a.begin < b.begin; });
    for (size_t i = 1; i < spans_.size(); ++i) {  // non-empty spans: neighbours tell
      const Span& before = spans_[i - 1];
      if (before.end > spans_[i].begin) {
        throw_invalid_argument(std::string(before.name) + " and " + spans_[i].name +
                              " overlap in " + tensor_.name);
      }
    }
  }

 private:
  struct Span {
    int64_t begin, end;
    const char* name;
  };
  Tensor tensor_;
  std::vector<Span> spans_;
};

}  // namespace

NANOGRAPH_BINDINGS(bind_sampling) {
  m.attr("MAX_TOP_LOGPROBS") = kMaxTopLogprobs;
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

  m.def(
      "sample_packed",
      [](py::object logits, py::object params, const std::vector<int64_t>& layout_values,
         py::object results, py::object overrides) {
        const PackedLayout l = read_layout(layout_values);
        const bool bf16_logits = py::str(logits.attr("dtype")).cast<std::string>() == "torch.bfloat16";
        auto [tl, row_stride] = row_strided_logits(logits, bf16_logits ? "bfloat16" : "float32");
        if (tl.size(0) != l.rows) {
          throw_invalid_argument("logits has " + std::to_string(tl.size(0)) +
                                " rows; the layout has " + std::to_string(l.rows));
        }
        const int64_t n = l.num_overrides;
        Tensor tov = optional_cuda_tensor(overrides, "overrides", "float32");
        if ((tov.ptr != nullptr) != (n > 0)) {
          throw_invalid_argument("the layout has " + std::to_string(n) + " override rows; pass " +
                                (n > 0 ? "overrides [n, vocab] float32" : "overrides=None"));
        }
        if (tov.ptr) expect_shape(tov, {n, tl.size(1)});
        Blob in(params, "params");
        Blob out(results, "results");
        same_device({&tl, &in.tensor(), &out.tensor(), &tov});
        SampleRowsArgs args;
        args.logits = tl.ptr;
        args.logits_bf16 = bf16_logits;
        args.logits_stride = row_stride;
        args.rows = static_cast<int>(l.rows);
        args.vocab = checked_int(tl.size(1), "vocab");
        args.temperatures = in.field<const float>("temperatures", l.temperatures, l.rows);
        args.top_ks = in.field<const int32_t>("top_ks", l.top_ks, l.rows);
        args.top_ps = in.field<const float>("top_ps", l.top_ps, l.rows);
        args.min_ps = in.field<const float>("min_ps", l.min_ps, l.rows);
        args.keys = in.field<const uint64_t>("keys", l.keys, l.rows);
        auto num_logprobs = in.field<const int32_t>("num_logprobs", l.num_logprobs, l.rows);
        auto override_rows = in.field<const int32_t>("override_rows", l.override_rows, l.rows);
        OverrideArgs o;
        o.logits = tl.ptr;
        o.logits_bf16 = bf16_logits;
        o.logits_stride = row_stride;
        o.vocab = args.vocab;
        o.num_rows = static_cast<int>(n);
        o.source_rows = in.field<const int32_t>("override_source", l.override_source, n);
        o.overrides = tov.data<float>();
        o.num_seen = static_cast<int>(l.seen_width);
        o.seen_tokens = in.field<const int32_t>("seen_tokens", l.seen_tokens, n * l.seen_width);
        o.output_counts =
            in.field<const int32_t>("output_counts", l.output_counts, n * l.seen_width);
        o.presence = in.field<const float>("presence", l.presence, n);
        o.frequency = in.field<const float>("frequency", l.frequency, n);
        o.repetition = in.field<const float>("repetition", l.repetition, n);
        o.num_masked = static_cast<int>(l.masked_width);
        o.masked_tokens =
            in.field<const int32_t>("masked_tokens", l.masked_tokens, n * l.masked_width);
        args.out = out.field<int64_t>("token_ids", l.token_ids, l.rows);
        const int64_t logprob_values = l.rows * l.logprob_columns;
        auto logprobs = out.field<float>("logprobs", l.logprobs, logprob_values);
        auto logprob_ids = out.field<int64_t>("logprob_ids", l.logprob_ids, logprob_values);
        in.disjoint();
        out.disjoint();
        if (n > 0) {
          args.overrides = o.overrides;
          args.overrides_stride = tl.size(1);
          args.override_rows = override_rows;
        }
        if (l.logprob_columns > 0) {
          args.num_logprobs = num_logprobs;
          args.logprob_width = static_cast<int>(l.logprob_columns) - 1;
          args.logprobs = logprobs;
          args.logprob_ids = logprob_ids;
        }
        cudaStream_t stream = torch_current_stream();
        if (n > 0) prepare_overrides(o, stream);
        sample_rows(args, stream);
      },
      py::arg("logits"), py::arg("params"), py::arg("layout"), py::arg("results"),
      py::arg("overrides") = py::none(),
      "sample_rows after prepare_overrides, their arrays read from two uint8 blobs at the byte "
      "offsets of layout, each a multiple of 16: (rows, logprob_columns, n, seen_width, "
      "masked_width, then the offsets in params of temperatures, top_ks, top_ps, min_ps, keys, "
      "num_logprobs, override_rows [rows], override_source [n], seen_tokens, output_counts "
      "[n, seen_width], presence, frequency, repetition [n], masked_tokens [n, masked_width], then "
      "the offsets in results of token_ids [rows] int64, logprobs [rows, logprob_columns] float32 "
      "and logprob_ids [rows, logprob_columns] int64), dtypes as in sample_rows and "
      "prepare_overrides. logits [rows, vocab] bf16 or float32 (rows may be strided); overrides "
      "[n, vocab] float32 scratch when n > 0, else None. n = 0: no overrides (override_rows is not "
      "read); logprob_columns = 0: no logprobs, else 1 + the most top logprobs a row asks for.");
}

}  // namespace nanograph::py_ext
