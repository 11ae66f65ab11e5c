// DecodeStack: every decoder layer of a decode batch (one new token per request, each request's KV read in place)
// in one call from Python.
//
// Why: at batch 1 a layer's kernels take ~0.25 ms together, and the Python around them (ten kernel calls through
// pybind, the checks that pick each kernel, the views between them) took ~30 us more per layer, ~1 ms of a ~9 ms
// step over 30 layers. The stack calls the same kernels (fastcpu_ops.h) in the same order with the same
// arguments as LlamaDecoderLayer.run through PackedCpuOps and the torch_native backend, so its result is the
// layer-by-layer result bit for bit; runtime/models/decode_stack.py decides which batches it takes.

#include "fastcpu_ops.h"

#include <array>
#include <chrono>
#include <map>
#include <string>
#include <utility>

namespace {

// One linear layer as PackedCpuOps packed it (runtime/models/packed.py) and the kernel for its layout: the one
// place that choice is made, for PackedCpuOps' layer-by-layer calls and for the stack alike.
struct PackedLinear {
  enum class Kernel { kPacked, kInt8, kBf16 };
  Kernel kernel;
  torch::Tensor data;
  c10::optional<torch::Tensor> scale;  // per output row (int8)
  int64_t n;
  int64_t act_block;  // linear_int8's activation block

  PackedLinear(const std::string& layout, torch::Tensor data_, int64_t n_, c10::optional<torch::Tensor> scale_,
               int64_t act_block_)
      : data(std::move(data_)), scale(std::move(scale_)), n(n_), act_block(act_block_) {
    if (layout == "kmajor") {
      kernel = Kernel::kPacked;
    } else if (layout == "vnni") {
      TORCH_CHECK(scale.has_value(), "vnni weights need their scales");
      kernel = Kernel::kInt8;
    } else {
      TORCH_CHECK(layout == "bf16pair", "unknown packed layout ", layout);
      kernel = Kernel::kBf16;
    }
  }

  // x @ W.T (+ bias, float32) in x's dtype, or added into `out` in place.
  torch::Tensor run(const torch::Tensor& x, const c10::optional<torch::Tensor>& bias,
                    const c10::optional<torch::Tensor>& out) const {
    switch (kernel) {
      case Kernel::kInt8:
        return linear_int8(x, data, n, *scale, bias, out, act_block);
      case Kernel::kBf16:
        return linear_bf16(x, data, n, bias, out);
      default:
        return linear_packed(x, data, n, scale, bias, out);
    }
  }
};

// A layer's linear and its bias (float32, or none).
struct Linear {
  PackedLinear weight;
  c10::optional<torch::Tensor> bias;
  torch::Tensor run(const torch::Tensor& x, const c10::optional<torch::Tensor>& out) const {
    return weight.run(x, bias, out);
  }
};

struct Layer {
  torch::Tensor input_norm, post_norm;
  Linear qkv, o, gate_up, down;
};

// A cascade group of the batch: rows start .. end - 1 whose KV begins with the same slots (a shared prefix of
// P positions), attended once for all of them per layer (extend_attention) and merged into each row's attention
// over its own KV. `packs[layer]` is pack_prefix's (K, V) of that layer where the caller keeps one, else empty
// (extend_attention packs per call).
struct SharedGroup {
  int64_t start, end;
  torch::Tensor slots;  // [P] int64
  torch::Tensor lengths;  // [end - start] int64, all P
  std::vector<std::vector<torch::Tensor>> packs;
};

// Where a run's wall time goes, phase by phase, summed over the layers of the runs since the last take(): what
// `radixserve bench profile` shows of the decoder layers (their linears against the attention and the small ops
// between them). Off by default: then each lap is one untaken branch. On, a lap reads the steady clock (~20-30 ns;
// 11 laps a layer, ~10 us a 30-layer step). The time of a phase is the leader's: a job's phase includes its wait
// for the other threads' parts. A phase is what runs between its lap and the one before: norms include the layer's
// pool views, own attention the copy of its output, and shared attention the FetchPlan, made with no group too.
class PhaseClock {
 public:
  enum Phase { kNorms, kQkv, kRotary, kStoreKv, kOwnAttention, kSharedAttention, kO, kGateUp, kSiluMul, kDown, kCount };
  static constexpr std::array<const char*, kCount> kNames = {
      "norms", "qkv", "rotary", "kv_store", "own_attention", "shared_attention", "o", "gate_up", "silu_mul", "down"};

  void enable(bool on) { on_ = on; }
  void start() {
    if (on_) last_ = Clock::now();
  }
  // The time since the last lap (or start) goes to `phase`.
  void lap(Phase phase) {
    if (!on_) return;
    const Clock::time_point now = Clock::now();
    spent_[phase] += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }
  void count_run() {
    if (on_) ++runs_;
  }
  // Seconds per phase summed over the timed runs, and "runs": how many; then zero.
  std::map<std::string, double> take() {
    std::map<std::string, double> out{{"runs", static_cast<double>(runs_)}};
    for (int i = 0; i < kCount; ++i) out[kNames[i]] = spent_[i];
    spent_.fill(0.0);
    runs_ = 0;
    return out;
  }

 private:
  using Clock = std::chrono::steady_clock;
  bool on_ = false;
  Clock::time_point last_;
  std::array<double, kCount> spent_{};
  int64_t runs_ = 0;
};

class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale)
      : heads_(heads), kv_heads_(kv_heads), d_(head_dim), eps_(eps), scale_(scale) {}

  // linears: qkv, o, gate_up, down; biases: theirs, in that order (float32, or none)
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, const std::vector<PackedLinear>& linears,
                 const std::vector<c10::optional<torch::Tensor>>& biases) {
    TORCH_CHECK(linears.size() == 4 && biases.size() == 4, "a layer has four linears (qkv, o, gate_up, down)");
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), {linears[0], biases[0]},
                            {linears[1], biases[1]}, {linears[2], biases[2]}, {linears[3], biases[3]}});
    for (const PackedLinear& lin : linears) weights_.push_back(fastcpu::panel_weight(lin.data));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  void time_phases(bool on) { clock_.enable(on); }
  std::map<std::string, double> take_phase_times() { return clock_.take(); }

  // residual [T, hidden] (updated in place); cos / sin_signed [T, D] in its dtype; slots [T] (where the new
  // tokens' K and V go); kv_index [B, L], row_index [T] and lengths [T]: token t attends kv_index[row_index[t]] up
  // to lengths[t] (row_index none: row t; after its group's shared prefix, for the rows of a group in `shared`). A
  // token of a prefill chunk is such a row too: every token's K and V are stored before any attends, and its length
  // stops at itself. k_buffer / v_buffer [layers, slots, kv_heads, row] (KVStorage's: row D, or D + 4 in the int8
  // format).
  void run(torch::Tensor residual, torch::Tensor cos, torch::Tensor sin_signed, torch::Tensor slots,
           torch::Tensor kv_index, torch::Tensor lengths, torch::Tensor k_buffer, torch::Tensor v_buffer,
           const std::vector<SharedGroup>& shared, const c10::optional<torch::Tensor>& row_index) const {
    TORCH_CHECK(k_buffer.dim() == 4 && k_buffer.size(0) == num_layers() && k_buffer.sizes() == v_buffer.sizes(),
                "k_buffer / v_buffer must be [layers, slots, kv_heads, head_dim] for every layer of the stack");
    for (const SharedGroup& g : shared)
      TORCH_CHECK(0 <= g.start && g.start < g.end && g.end <= residual.size(0) &&
                      g.lengths.numel() == g.end - g.start &&
                      (g.packs.empty() || static_cast<int64_t>(g.packs.size()) == num_layers()),
                  "a shared group needs rows within the batch, a length per row, and a pack per layer or none");
    const int64_t t = residual.size(0), q_size = heads_ * d_, kv_size = kv_heads_ * d_;
    // a slot's row in the pool: kv_size values, or in the int8 format each head's d values and its scale
    const int64_t total_slots = k_buffer.size(1), slot_row = kv_heads_ * k_buffer.size(3);
    check_decode_slots(kv_index, row_index, lengths, total_slots);  // once: every layer reads the same slots
    fastcpu::Team::run([&](fastcpu::Team& team) {
      // The linears split their panels between threads as the plan's shares assume up to kInt8ChunkRows rows
      // (past that int8 splits a panel's rows too): a decode batch's idle threads fetch the next weights.
      if (t <= fastcpu::kInt8ChunkRows) team.fetch_ahead(&weights_);
      using P = PhaseClock;
      clock_.start();
      for (int64_t i = 0; i < num_layers(); ++i) {
        const Layer& layer = layers_[i];
        const int64_t first = 4 * i;  // the layer's qkv in weights_, then o, gate/up, down
        const torch::Tensor k_pool = k_buffer.select(0, i).view({total_slots, slot_row});
        const torch::Tensor v_pool = v_buffer.select(0, i).view({total_slots, slot_row});
        // Before each linear runs, the idle threads move on to the one after it: a thread that finishes its
        // share early fetches ahead instead of walking the share it has just read.
        const torch::Tensor x = rms_norm(residual, layer.input_norm, eps_);
        clock_.lap(P::kNorms);
        team.ahead_from(first + 1);
        torch::Tensor qkv = layer.qkv.run(x, c10::nullopt);
        clock_.lap(P::kQkv);
        // q and k heads side by side: one rotation for both
        torch::Tensor qk =
            rotary(qkv.narrow(1, 0, q_size + kv_size).view({t, heads_ + kv_heads_, d_}), cos, sin_signed);
        clock_.lap(P::kRotary);
        store_kv(k_pool, v_pool, slots, qk.narrow(1, heads_, kv_heads_),
                 qkv.narrow(1, q_size + kv_size, kv_size).view({t, kv_heads_, d_}));
        clock_.lap(P::kStoreKv);
        const torch::Tensor q = qk.narrow(1, 0, heads_);
        std::vector<torch::Tensor> own = decode_attention_unchecked(q, k_pool, v_pool, kv_index, row_index, lengths,
                                                                    scale_, kv_heads_);
        const torch::Tensor attn = own[0].contiguous();
        clock_.lap(P::kOwnAttention);
        // the shared part computes from its kept pack: meanwhile the memory brings in this layer's next weights
        fastcpu::FetchPlan next;
        for (const Linear* lin : {&layer.o, &layer.gate_up, &layer.down}) next.add(lin->weight.data);
        for (const SharedGroup& g : shared) {
          const int64_t n = g.end - g.start;
          c10::optional<std::vector<torch::Tensor>> pack;
          if (!g.packs.empty() && !g.packs[i].empty()) pack = g.packs[i];
          std::vector<torch::Tensor> part = extend_attention(q.narrow(0, g.start, n), k_pool, v_pool, g.slots,
                                                             g.lengths, scale_, kv_heads_, pack, &next);
          merge_attention(attn.narrow(0, g.start, n), own[1].narrow(0, g.start, n), part[0], part[1]);
        }
        clock_.lap(P::kSharedAttention);
        team.ahead_from(first + 2);
        layer.o.run(attn.view({t, q_size}), residual);
        clock_.lap(P::kO);
        const torch::Tensor h = rms_norm(residual, layer.post_norm, eps_);
        clock_.lap(P::kNorms);
        team.ahead_from(first + 3);
        torch::Tensor gate_up = layer.gate_up.run(h, c10::nullopt);
        clock_.lap(P::kGateUp);
        const torch::Tensor act = silu_mul(gate_up);
        clock_.lap(P::kSiluMul);
        team.ahead_from(first + 4);
        layer.down.run(act, residual);
        clock_.lap(P::kDown);
      }
      clock_.count_run();
    });
  }

 private:
  int64_t heads_, kv_heads_, d_;
  double eps_, scale_;
  std::vector<Layer> layers_;
  std::vector<fastcpu::PanelWeight> weights_;  // every layer's qkv, o, gate/up and down, in the order they run
  mutable PhaseClock clock_;  // run() is const: the clock is the one thing it changes besides its outputs
};

}  // namespace

void bind_decoder(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<PackedLinear>(m, "PackedLinear", "one packed linear layer and the kernel for its layout")
      .def(py::init<const std::string&, torch::Tensor, int64_t, c10::optional<torch::Tensor>, int64_t>(),
           py::arg("layout"), py::arg("data"), py::arg("n"), py::arg("scale"), py::arg("act_block"))
      .def("run", &PackedLinear::run, py::arg("x"), py::arg("bias"), py::arg("out"),
           "x @ W.T (+ bias) in x's dtype (float32 or bfloat16), or added into out in place (returned)");
  py::class_<SharedGroup>(m, "SharedGroup", "a cascade group of a decode batch: rows sharing a KV prefix")
      .def(py::init<int64_t, int64_t, torch::Tensor, torch::Tensor, std::vector<std::vector<torch::Tensor>>>(),
           py::arg("start"), py::arg("end"), py::arg("slots"), py::arg("lengths"), py::arg("packs"));
  py::class_<DecodeStack>(m, "DecodeStack", "the decoder layers of a decode batch in one call")
      .def(py::init<int64_t, int64_t, int64_t, double, double>(), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("eps"), py::arg("scale"))
      .def("add_layer", &DecodeStack::add_layer, py::arg("input_norm"), py::arg("post_norm"), py::arg("linears"),
           py::arg("biases"))
      .def_property_readonly("num_layers", &DecodeStack::num_layers)
      .def("time_phases", &DecodeStack::time_phases, py::arg("on"),
           "time each phase of the layers (norms, qkv, rotary, kv_store, own_attention, shared_attention, o, gate_up, "
           "silu_mul, down) in the runs from now on, or stop")
      .def("take_phase_times", &DecodeStack::take_phase_times,
           "seconds per phase summed over the timed runs since the last call, and 'runs': how many; then zero")
      // the GIL is released while the layers run: other threads of the scheduler process keep going
      .def("run", &DecodeStack::run, py::arg("residual"), py::arg("cos"), py::arg("sin_signed"), py::arg("slots"),
           py::arg("kv_index"), py::arg("lengths"), py::arg("k_buffer"), py::arg("v_buffer"),
           py::arg("shared") = std::vector<SharedGroup>{}, py::arg("row_index") = c10::optional<torch::Tensor>(),
           py::call_guard<py::gil_scoped_release>());
}
