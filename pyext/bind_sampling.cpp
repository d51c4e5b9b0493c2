// Bindings for the sampling kernels (csrc/sampling.h): sample_rows and prepare_overrides, each
// from separate tensors, apply_token_bitmask (structured outputs' grammar mask), and sample_packed, which runs both from two blobs: the parameters, one
// uint8 tensor the host fills and sends in one copy, and the results, one uint8 tensor read back
// in one copy. The blobs' layout is declared once, here (kPackedFields), and exported by
// sample_packed_layout(), from which python/nanograph/sampling/packed_layout.py places the fields.
// Checking two blobs and a tuple of offsets costs the host far less than reading some twenty
// tensors' attributes.
#include <algorithm>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../csrc/sampling.h"
#include "tensor.h"

namespace nanograph::py_ext {

namespace {

// The counts that size one packed call, in the order sample_packed's layout tuple starts with.
enum Count {
  kRows, kLogprobColumns, kNumOverrides, kSeenWidth, kMaskedWidth, kBiasWidth, kNumCounts
};
constexpr const char* kCountNames[kNumCounts] = {"rows",       "logprob_columns", "num_overrides",
                                                 "seen_width", "masked_width",    "bias_width"};

enum class BlobKind { kParams, kResults };

struct PackedField {
  BlobKind blob;
  const char* name;
  const char* dtype;  // as torch and numpy name it
  int rank;           // dims[0], or dims[0] x dims[1]
  Count dims[2];
};

// Every field of the two blobs, in the order of their offsets in the layout tuple (after the
// counts); n = num_overrides. What each holds: SampleRowsArgs and OverrideArgs in csrc/sampling.h.
constexpr PackedField kPackedFields[] = {
    {BlobKind::kParams, "temperatures", "float32", 1, {kRows}},
    {BlobKind::kParams, "top_ks", "int32", 1, {kRows}},
    {BlobKind::kParams, "top_ps", "float32", 1, {kRows}},
    {BlobKind::kParams, "min_ps", "float32", 1, {kRows}},
    {BlobKind::kParams, "keys", "int64", 1, {kRows}},
    {BlobKind::kParams, "num_logprobs", "int32", 1, {kRows}},
    {BlobKind::kParams, "override_rows", "int32", 1, {kRows}},
    {BlobKind::kParams, "override_source", "int32", 1, {kNumOverrides}},
    {BlobKind::kParams, "seen_tokens", "int32", 2, {kNumOverrides, kSeenWidth}},
    {BlobKind::kParams, "output_counts", "int32", 2, {kNumOverrides, kSeenWidth}},
    {BlobKind::kParams, "presence", "float32", 1, {kNumOverrides}},
    {BlobKind::kParams, "frequency", "float32", 1, {kNumOverrides}},
    {BlobKind::kParams, "repetition", "float32", 1, {kNumOverrides}},
    {BlobKind::kParams, "masked_tokens", "int32", 2, {kNumOverrides, kMaskedWidth}},
    {BlobKind::kParams, "biased_tokens", "int32", 2, {kNumOverrides, kBiasWidth}},
    {BlobKind::kParams, "biases", "float32", 2, {kNumOverrides, kBiasWidth}},
    {BlobKind::kParams, "mask_others", "int32", 1, {kNumOverrides}},
    {BlobKind::kResults, "token_ids", "int64", 1, {kRows}},
    {BlobKind::kResults, "logprobs", "float32", 2, {kRows, kLogprobColumns}},
    {BlobKind::kResults, "logprob_ids", "int64", 2, {kRows, kLogprobColumns}},
};
constexpr size_t kNumPackedFields = sizeof(kPackedFields) / sizeof(kPackedFields[0]);
constexpr int64_t kFieldAlignment = 16;  // of every field's offset (and of each blob's start)

// The index in kPackedFields of the field called name; kNumPackedFields if none is.
constexpr size_t packed_field(std::string_view name) {
  size_t i = 0;
  while (i < kNumPackedFields && std::string_view(kPackedFields[i].name) != name) ++i;
  return i;
}

// The dtype of a field whose elements the kernels read as T.
template <class T>
constexpr std::string_view dtype_of() {
  using U = std::remove_const_t<T>;
  if constexpr (std::is_same_v<U, float>) {
    return "float32";
  } else if constexpr (std::is_same_v<U, int32_t>) {
    return "int32";
  } else {
    static_assert(std::is_same_v<U, int64_t> || std::is_same_v<U, uint64_t>,
                  "packed fields hold float32, int32 or int64 elements");
    return "int64";  // keys: their bits
  }
}

// One call's layout as sample_packed takes it: the counts, then each field's byte offset.
class PackedLayout {
 public:
  explicit PackedLayout(std::vector<int64_t> values) : values_(std::move(values)) {
    if (values_.size() != kNumCounts + kNumPackedFields) {
      throw_invalid_argument("layout has " + std::to_string(values_.size()) + " values; it takes " +
                             std::to_string(kNumCounts + kNumPackedFields) + " (" +
                             std::to_string(kNumCounts) + " counts, then " +
                             std::to_string(kNumPackedFields) +
                             " offsets: see sample_packed_layout())");
    }
    for (int c = 0; c < kNumCounts; ++c) {
      const std::string what = std::string("layout's ") + kCountNames[c];
      if (values_[c] < 0) throw_invalid_argument(what + " is negative");
      checked_int(values_[c], what);
    }
    if (count(kLogprobColumns) > 1 + kMaxTopLogprobs) {
      throw_invalid_argument("layout has " + std::to_string(count(kLogprobColumns)) +
                             " logprob columns; the kernel takes at most 1 + " +
                             std::to_string(kMaxTopLogprobs));
    }
  }

  int64_t count(Count c) const { return values_[c]; }
  int64_t offset(size_t field) const { return values_[kNumCounts + field]; }
  int64_t elements(size_t field) const {
    const PackedField& f = kPackedFields[field];
    int64_t n = 1;
    for (int d = 0; d < f.rank; ++d) n *= count(f.dims[d]);
    return n;
  }

 private:
  std::vector<int64_t> values_;
};

// A uint8 tensor holding the fields of one blob at the layout's offsets. field() checks that one
// lies inside it, at an aligned offset; disjoint() that no two non-empty ones overlap.
template <BlobKind kKind>
class Blob {
 public:
  Blob(py::handle obj, const PackedLayout& layout)
      : tensor_(cuda_tensor(obj, kKind == BlobKind::kParams ? "params" : "results", "uint8")),
        layout_(layout) {
    expect_shape(tensor_, {-1});
    if (reinterpret_cast<uintptr_t>(tensor_.ptr) % kFieldAlignment != 0) {
      throw_invalid_argument(tensor_.name + " must start at a " + std::to_string(kFieldAlignment) +
                             "-byte boundary (a fresh tensor does)");
    }
  }

  const Tensor& tensor() const { return tensor_; }

  // kPackedFields[kField], which must lie in this blob and hold elements of T's dtype.
  template <class T, size_t kField>
  T* field() {
    static_assert(kField < kNumPackedFields, "no field of that name in kPackedFields");
    static_assert(kPackedFields[kField].blob == kKind, "the field lies in the other blob");
    static_assert(std::string_view(kPackedFields[kField].dtype) == dtype_of<T>(),
                  "the field's dtype in kPackedFields is not T's");
    const char* name = kPackedFields[kField].name;
    const int64_t offset = layout_.offset(kField), count = layout_.elements(kField);
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
  const PackedLayout& layout_;
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
      "apply_token_bitmask",
      [](py::object logits, py::object bitmask, py::object rows) {
        const bool bf16_logits = py::str(logits.attr("dtype")).cast<std::string>() == "torch.bfloat16";
        auto [tl, row_stride] = row_strided_logits(logits, bf16_logits ? "bfloat16" : "float32");
        Tensor tb = cuda_tensor(bitmask, "bitmask", "int32");
        Tensor tr = cuda_tensor(rows, "rows", "int32");
        const int64_t n = tr.size(0);
        expect_shape(tr, {-1});
        expect_shape(tb, {n, (tl.size(1) + 31) / 32});
        same_device({&tl, &tb, &tr});
        apply_token_bitmask(tl.ptr, bf16_logits, row_stride, checked_int(tl.size(1), "vocab"),
                            tb.data<int32_t>(), checked_int(tb.size(1), "bitmask words"),
                            tr.data<int32_t>(), checked_int(n, "rows"), torch_current_stream());
      },
      py::arg("logits"), py::arg("bitmask"), py::arg("rows"),
      "In place: logits[rows[i], t] = -inf where bit t % 32 of bitmask[i, t // 32] is 0. logits "
      "[*, vocab] bf16 or float32 (rows may be strided); bitmask [n, ceil(vocab / 32)] int32; rows "
      "[n] int32, each a row of logits.");

  m.def(
      "sample_packed_layout",
      [] {
        py::list counts, fields;
        for (const char* name : kCountNames) counts.append(name);
        for (const PackedField& f : kPackedFields) {
          py::list dims;
          for (int d = 0; d < f.rank; ++d) dims.append(kCountNames[f.dims[d]]);
          fields.append(py::make_tuple(f.blob == BlobKind::kParams ? "params" : "results", f.name,
                                       f.dtype, py::tuple(dims)));
        }
        py::dict layout;
        layout["alignment"] = kFieldAlignment;
        layout["counts"] = py::tuple(counts);
        layout["fields"] = fields;
        return layout;
      },
      "sample_packed's two blobs, as this binding reads them: {'alignment': the bytes every "
      "field's offset is a multiple of, 'counts': the names of the counts the layout tuple starts "
      "with, in order, 'fields': [(blob, name, dtype, shape)] in the order of their offsets in the "
      "tuple, blob 'params' or 'results', dtype 'float32', 'int32' or 'int64', shape a tuple of "
      "count names}.");

  m.def(
      "sample_packed",
      [](py::object logits, py::object params, std::vector<int64_t> layout_values,
         py::object results, py::object overrides) {
        const PackedLayout layout(std::move(layout_values));
        const bool bf16_logits = py::str(logits.attr("dtype")).cast<std::string>() == "torch.bfloat16";
        auto [tl, row_stride] = row_strided_logits(logits, bf16_logits ? "bfloat16" : "float32");
        const int64_t rows = layout.count(kRows);
        if (tl.size(0) != rows) {
          throw_invalid_argument("logits has " + std::to_string(tl.size(0)) +
                                 " rows; the layout has " + std::to_string(rows));
        }
        const int64_t n = layout.count(kNumOverrides);
        Tensor tov = optional_cuda_tensor(overrides, "overrides", "float32");
        if ((tov.ptr != nullptr) != (n > 0)) {
          throw_invalid_argument("the layout has " + std::to_string(n) + " override rows; pass " +
                                 (n > 0 ? "overrides [n, vocab] float32" : "overrides=None"));
        }
        if (tov.ptr) expect_shape(tov, {n, tl.size(1)});
        Blob<BlobKind::kParams> in(params, layout);
        Blob<BlobKind::kResults> out(results, layout);
        same_device({&tl, &in.tensor(), &out.tensor(), &tov});
        SampleRowsArgs args;
        args.logits = tl.ptr;
        args.logits_bf16 = bf16_logits;
        args.logits_stride = row_stride;
        args.rows = static_cast<int>(rows);
        args.vocab = checked_int(tl.size(1), "vocab");
        args.temperatures = in.field<const float, packed_field("temperatures")>();
        args.top_ks = in.field<const int32_t, packed_field("top_ks")>();
        args.top_ps = in.field<const float, packed_field("top_ps")>();
        args.min_ps = in.field<const float, packed_field("min_ps")>();
        args.keys = in.field<const uint64_t, packed_field("keys")>();
        auto num_logprobs = in.field<const int32_t, packed_field("num_logprobs")>();
        auto override_rows = in.field<const int32_t, packed_field("override_rows")>();
        OverrideArgs o;
        o.logits = tl.ptr;
        o.logits_bf16 = bf16_logits;
        o.logits_stride = row_stride;
        o.vocab = args.vocab;
        o.num_rows = static_cast<int>(n);
        o.source_rows = in.field<const int32_t, packed_field("override_source")>();
        o.overrides = tov.data<float>();
        o.num_seen = static_cast<int>(layout.count(kSeenWidth));
        o.seen_tokens = in.field<const int32_t, packed_field("seen_tokens")>();
        o.output_counts = in.field<const int32_t, packed_field("output_counts")>();
        o.presence = in.field<const float, packed_field("presence")>();
        o.frequency = in.field<const float, packed_field("frequency")>();
        o.repetition = in.field<const float, packed_field("repetition")>();
        o.num_masked = static_cast<int>(layout.count(kMaskedWidth));
        o.masked_tokens = in.field<const int32_t, packed_field("masked_tokens")>();
        o.num_biased = static_cast<int>(layout.count(kBiasWidth));
        o.biased_tokens = in.field<const int32_t, packed_field("biased_tokens")>();
        o.biases = in.field<const float, packed_field("biases")>();
        o.mask_others = in.field<const int32_t, packed_field("mask_others")>();
        args.out = out.field<int64_t, packed_field("token_ids")>();
        auto logprobs = out.field<float, packed_field("logprobs")>();
        auto logprob_ids = out.field<int64_t, packed_field("logprob_ids")>();
        in.disjoint();
        out.disjoint();
        if (n > 0) {
          args.overrides = o.overrides;
          args.overrides_stride = tl.size(1);
          args.override_rows = override_rows;
        }
        const int64_t logprob_columns = layout.count(kLogprobColumns);
        if (logprob_columns > 0) {
          args.num_logprobs = num_logprobs;
          args.logprob_width = static_cast<int>(logprob_columns) - 1;
          args.logprobs = logprobs;
          args.logprob_ids = logprob_ids;
        }
        cudaStream_t stream = torch_current_stream();
        if (n > 0) prepare_overrides(o, stream);
        sample_rows(args, stream);
      },
      py::arg("logits"), py::arg("params"), py::arg("layout"), py::arg("results"),
      py::arg("overrides") = py::none(),
      "sample_rows after prepare_overrides, their arrays read from two uint8 blobs, params and "
      "results, at the byte offsets of layout: the counts (rows, logprob_columns, n, seen_width, "
      "masked_width, bias_width), then each field's offset, a multiple of 16, in the order, with the dtypes and "
      "shapes, that sample_packed_layout() gives. logits [rows, vocab] bf16 or float32 (rows may "
      "be strided); overrides [n, vocab] float32 scratch when n > 0, else None. n = 0: no "
      "overrides (override_rows is not read); logprob_columns = 0: no logprobs, else 1 + the most "
      "top logprobs a row asks for.");
}

}  // namespace nanograph::py_ext
