"""The mixture-of-experts feed-forward: a router, experts held as stacked tensors, shared
experts, and a backend that computes the experts (chosen once, when the model is built).

    x [T, H] -> router -> top-k (weights [T, k] float32, expert ids [T, k])
             -> experts: sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, j]
             (+ shared experts, optionally scaled by sigmoid(x @ shared_expert_gate))

Routers (`Router`, ModelConfig.moe): softmax over the experts then top-k, the k weights
renormalized or not (`norm_topk_prob`: Mixtral always, Qwen2/3-MoE and OLMoE by config); or
the DeepSeek-style router (GLM-4.5, MiniMax-M2): sigmoid scores, `e_score_correction_bias`
added for the choice only, the choice limited to the best `topk_group` of `n_group` groups
(ranked by the sum of their two best scores), the chosen sigmoid scores renormalized and
scaled by `routed_scaling_factor`.

The experts (`Experts`) are two parameters: gate_up_proj [E, 2I, H] (per expert the gate
projection's I rows, then up's) and down_proj [E, H, I]. Their weight loader takes every
layout these families ship: per-expert 2-D tensors (`experts.N.{gate,up,down}_proj`, Mixtral's
`w1/w3/w2`: a shard (N, part)), or the fused 3-D tensors transformers 5 saves (whole). Under
tensor parallelism each rank holds every expert's slice of I (gate/up column-parallel, down
row-parallel, one all-reduce after the shared experts are added); with expert parallelism
(`--expert-parallel`) each rank holds E/N whole experts (uneven when N does not divide E) and
reads only theirs from the checkpoint.

Backends (`moe_method_for`, `--moe-backend`):
- `ReferenceMoE`: a loop over the experts that received tokens, F.linear on the stacked
  weights: HF's arithmetic, the reference the others are tested against.
- `GroupedMoE` (CPUs, and integer weights anywhere): tokens sorted by expert once, each hit
  expert's rows one contiguous group through the model's own linear method (engine.layers.
  linear: our AVX2/AVX-512/AMX kernels, oneDNN, int8 panels with --quantization int8), its
  weights packed per expert after loading. `pdserve stepbench --moe-backend` compares them.
- `TritonMoE` (CUDA, float weights): pdkernels/triton_moe.py, tokens sorted and padded per
  expert, block GEMMs over the stacked weights with SiLU-and-mul fused, the top-k weights
  applied in the second GEMM's epilogue.

Expert parallelism (`MoE._forward_ep`): attention stays tensor-parallel, so every rank holds
all T tokens after it. Each rank routes all of them (cheap, and rank 0's routing counts are
then the whole step's), takes its slice of T/N tokens, sends each (token, expert) row to the
rank holding that expert (all_to_all_single of the row counts, then of the rows and their
local expert ids), computes what it received, sends the results back the same way, weights
and sums them per token, adds the shared experts for its slice, and all-gathers the slices.

Visible: `counts` [E] int64 on every MoE layer, the rows each expert computed (on GPUs with
decode graphs, padding rows included), summed per expert on /metrics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import MOE_BACKENDS, ModelConfig, MoEConfig
from engine.layers import LayerOptions
from engine.layers.linear import DenseMethod, Linear, LinearMethod
from engine.layers.mlp import GatedMLP
from engine.parallel import SINGLE, TPGroup


def expert_range(num_experts: int, size: int, rank: int) -> tuple[int, int]:
    """(first expert, count) rank `rank` of `size` holds under expert parallelism: contiguous,
    the remainder spread over the later ranks (7 over 3: 2, 2, 3)."""
    first = rank * num_experts // size
    return first, (rank + 1) * num_experts // size - first


class Router(nn.Module):
    """`weight` [E, H] (the checkpoint's `gate`), optional `e_score_correction_bias` [E].
    forward(x [T, H]) -> (weights [T, k] float32, ids [T, k] int64)."""

    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(moe.num_experts), requires_grad=False)
                     if moe.router_bias else None)
        names = ("weight",) if moe.scoring == "sigmoid" else ()     # scored in float32
        if moe.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts),
                                                        requires_grad=False)
            names += ("e_score_correction_bias",)
        self.float32_params = names

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        if moe.scoring == "softmax":
            scores = F.linear(x, self.weight, self.bias).float().softmax(-1)   # [T, E]
        else:
            scores = F.linear(x.float(), self.weight.float()).sigmoid()   # [T, E]
        choice = scores
        if moe.correction_bias:
            choice = scores + self.e_score_correction_bias
        if moe.n_group > 1:
            t, per = choice.shape[0], moe.num_experts // moe.n_group
            groups = choice.view(t, moe.n_group, per).topk(min(2, per), dim=-1)[0].sum(-1)
            best = groups.topk(moe.topk_group, dim=-1, sorted=False)[1]       # [T, topk_group]
            keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
        ids = choice.topk(moe.top_k, dim=-1)[1]                              # [T, k]
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            denom = weights.sum(-1, keepdim=True)
            weights = weights / (denom + 1e-20 if moe.scoring == "sigmoid" else denom)
        if moe.routed_scaling_factor != 1.0:
            weights = weights * moe.routed_scaling_factor
        return weights, ids


class Experts(nn.Module):
    """This rank's experts: gate_up_proj [E_local, 2 * I_local, H], down_proj [E_local, H,
    I_local] (see the module docstring for how ranks split them)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup,
                 expert_parallel: bool, moe: MoEConfig | None = None) -> None:
        super().__init__()
        self.moe = moe
        self.num_experts, self.hidden, self.full_i = num_experts, hidden, intermediate
        self.tp, self.ep = tp, expert_parallel and tp.size > 1
        if self.ep:
            self.first, self.local = expert_range(num_experts, tp.size, tp.rank)
            self.inter, self.i_start = intermediate, 0
        else:
            if intermediate % tp.size:
                raise ValueError(f"expert intermediate size {intermediate} does not split over "
                                 f"{tp.size} tensor-parallel ranks (try --expert-parallel)")
            self.first, self.local = 0, num_experts
            self.inter = intermediate // tp.size
            self.i_start = tp.rank * self.inter
        self.gate_up_proj = nn.Parameter(torch.empty(self.local, 2 * self.inter, hidden),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(self.local, hidden, self.inter),
                                      requires_grad=False)
        self.gate_up_proj_bias = self.down_proj_bias = None
        if moe is not None and moe.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(self.local, 2 * self.inter),
                                                  requires_grad=False)
            # added once: under tensor parallelism (not expert) by rank 0 only, before the
            # all-reduce of the ranks' partial sums
            self.down_proj_bias = nn.Parameter(torch.zeros(self.local, hidden),
                                               requires_grad=False)
        self.method: "MoEMethod | None" = None          # set by MoE

    def act(self, h: torch.Tensor) -> torch.Tensor:
        """[R, 2I] (gate columns, then up) -> [R, I]: the experts' activation."""
        gate, up = h.chunk(2, dim=-1)
        if self.moe is None or self.moe.activation == "silu":
            return F.silu(gate) * up
        limit, alpha = self.moe.swiglu_limit, self.moe.swiglu_alpha
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    def _bias_loader(self, param: nn.Parameter, loaded) -> None:
        i, full = self.inter, self.full_i
        interleaved = self.moe.fused_layout == "transposed_interleaved"
        if param is self.gate_up_proj_bias:
            want = (self.num_experts, 2 * full)
        else:
            want = (self.num_experts, self.hidden)
        if tuple(loaded.shape) != want:
            raise ValueError(f"checkpoint gives {tuple(loaded.shape)}, model expects {want}")
        for e in range(self.local):
            one = loaded.narrow(0, self.first + e, 1)[0]
            if param is self.down_proj_bias:   # (built on the meta device: zeros written)
                if self.ep or self.tp.rank == 0:
                    param.data[e].copy_(one)
                else:
                    param.data[e].zero_()
                continue
            gate, up = (one[0::2], one[1::2]) if interleaved else (one[:full], one[full:])
            param.data[e, :i].copy_(gate.narrow(0, self.i_start, i))
            param.data[e, i:].copy_(up.narrow(0, self.i_start, i))

    def expected_shards(self, attr: str, shards: set) -> int:
        """How many checkpoint tensors fill `attr` (engine.weights checks every one came)."""
        if None in shards:
            return 1
        return self.num_experts * (2 if attr == "gate_up_proj" else 1)

    def owns(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.local

    def weight_loader(self, param: nn.Parameter, loaded, shard=None) -> None:
        h, i, full = self.hidden, self.inter, self.full_i
        if param is self.gate_up_proj_bias or param is self.down_proj_bias:
            return self._bias_loader(param, loaded)
        if shard is None and self.moe is not None and \
                self.moe.fused_layout == "transposed_interleaved":
            return self._transposed_loader(param, loaded)
        if shard is None:                       # a fused [E, 2I, H] or [E, H, I] tensor
            down = param is self.down_proj
            want = (self.num_experts, h, full) if down else (self.num_experts, 2 * full, h)
            if tuple(loaded.shape) != want:
                raise ValueError(f"checkpoint gives {tuple(loaded.shape)}, model expects {want}")
            for e in range(self.local):        # one expert read at a time
                one = loaded.narrow(0, self.first + e, 1)[0]
                if down:
                    param.data[e].copy_(one.narrow(1, self.i_start, i))
                else:
                    param.data[e, :i].copy_(one.narrow(0, self.i_start, i))
                    param.data[e, i:].copy_(one.narrow(0, full + self.i_start, i))
            return
        expert, part = shard
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} of a layer with {self.num_experts}")
        want = (h, full) if part == "down" else (full, h)
        if tuple(loaded.shape) != want:
            raise ValueError(f"expert {expert} {part}: checkpoint gives {tuple(loaded.shape)}, "
                             f"model expects {want}")
        if not self.owns(expert):
            return                              # another rank's: not read
        e = expert - self.first
        if part == "down":
            param.data[e].copy_(loaded.narrow(1, self.i_start, i))
        else:
            rows = slice(0, i) if part == "gate" else slice(i, 2 * i)
            param.data[e, rows].copy_(loaded.narrow(0, self.i_start, i))

    def _transposed_loader(self, param: nn.Parameter, loaded) -> None:
        """gpt-oss: gate_up [E, H, 2I], gate and up columns alternating; down [E, I, H]."""
        h, i, full = self.hidden, self.inter, self.full_i
        down = param is self.down_proj
        want = (self.num_experts, full, h) if down else (self.num_experts, h, 2 * full)
        if tuple(loaded.shape) != want:
            raise ValueError(f"checkpoint gives {tuple(loaded.shape)}, model expects {want}")
        for e in range(self.local):
            one = loaded.narrow(0, self.first + e, 1)[0].t()          # [H, I] or [2I, H]
            if down:
                param.data[e].copy_(one.narrow(1, self.i_start, i))
            else:
                param.data[e, :i].copy_(one[0::2].narrow(0, self.i_start, i))
                param.data[e, i:].copy_(one[1::2].narrow(0, self.i_start, i))

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)


class MoEMethod:
    """How the experts compute: apply(experts, x [R, H], weights [R, k] float32, ids [R, k])
    -> [R, H], ids local to the rank (-1: not here, contributes nothing)."""

    name = "reference"
    graph_safe = False       # no host sync inside: a CUDA graph can capture it

    def process_weights_after_loading(self, experts: Experts) -> None:
        pass

    def apply(self, experts: Experts, x: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat = ids.flatten()
        gb, db = experts.gate_up_proj_bias, experts.down_proj_bias
        for e in torch.unique(flat[flat >= 0]).tolist():
            token, slot = torch.where(ids == e)
            h = F.linear(x[token], experts.gate_up_proj[e], None if gb is None else gb[e])
            y = F.linear(experts.act(h), experts.down_proj[e], None if db is None else db[e])
            out.index_add_(0, token, (y * weights[token, slot, None].to(y.dtype)).float())
        return out.to(x.dtype)


ReferenceMoE = MoEMethod


class GroupedMoE(MoEMethod):
    """Tokens grouped by expert, each group through `linear` (the model's linear method) over
    that expert's weights, packed once after loading."""

    name = "grouped"

    def __init__(self, linear: LinearMethod) -> None:
        self.linear = linear

    def process_weights_after_loading(self, experts: Experts) -> None:
        h, i = experts.hidden, experts.inter
        gate_up, down = nn.ModuleList(), nn.ModuleList()
        for e in range(experts.local):
            for dst, w, shape in ((gate_up, experts.gate_up_proj, (2 * i, h)),
                                  (down, experts.down_proj, (h, i))):
                with torch.device("meta"):
                    layer = Linear(shape[1], shape[0], False, DenseMethod())
                layer.method = self.linear
                layer.weight = nn.Parameter(w.data[e], requires_grad=False)
                self.linear.process_weights_after_loading(layer)
                dst.append(layer)
        experts.expert_gate_up, experts.expert_down = gate_up, down
        if type(self.linear) is not DenseMethod:     # the experts' layers hold their own copies
            del experts.gate_up_proj, experts.down_proj
            experts.gate_up_proj = experts.down_proj = None

    def apply(self, experts: Experts, x: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
        t, k = ids.shape
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat + 1, minlength=experts.local + 1).tolist()   # -1 first
        rows = order // k                                          # token of each sorted slot
        out = torch.zeros(t * k, x.shape[1], dtype=x.dtype, device=x.device)
        start = counts[0]
        gb, db = experts.gate_up_proj_bias, experts.down_proj_bias
        for e, n in enumerate(counts[1:]):
            if n:
                sel = order[start:start + n]
                g = experts.expert_gate_up[e](x[rows[start:start + n]])
                if gb is not None:
                    g = g + gb[e]
                y = experts.expert_down[e](experts.act(g))
                out[sel] = y if db is None else y + db[e]
                start += n
        w = weights.to(x.dtype).view(t, k, 1)
        return (out.view(t, k, x.shape[1]) * w).sum(1)


class TritonMoE(MoEMethod):
    """pdkernels/triton_moe.py over the stacked weights (CUDA)."""

    name = "triton"
    graph_safe = True

    def __init__(self, num_sms: int | None = None) -> None:
        from pdkernels.triton_moe import fused_moe
        self._fused, self.num_sms = fused_moe, num_sms

    def apply(self, experts: Experts, x: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
        moe = experts.moe
        extra = {}
        if moe is not None and (moe.expert_bias or moe.activation != "silu"):
            extra = dict(b13=experts.gate_up_proj_bias, b2=experts.down_proj_bias,
                         activation=moe.activation, alpha=moe.swiglu_alpha,
                         limit=moe.swiglu_limit)
        return self._fused(x.contiguous(), experts.gate_up_proj, experts.down_proj,
                           weights.float().contiguous(), ids.contiguous(), self.num_sms,
                           **extra)


def graph_safe(model: nn.Module) -> bool:
    """Whether every MoE layer of `model` can be captured in a CUDA graph (the grouped and
    reference backends read the expert counts on the host)."""
    return all(m.method.graph_safe for m in model.modules() if isinstance(m, Experts))


def moe_method_for(opts: LayerOptions, moe: MoEConfig | None = None) -> MoEMethod:
    """The backend for `opts` (`opts.moe_backend`: auto, or one forced); every backend takes
    the experts' biases and activation (`moe`)."""
    choice, linear = opts.moe_backend, opts.linear
    float_weights = linear.name not in ("int8",) and not hasattr(linear, "scheme")
    if choice == "reference":
        if not float_weights:
            raise ValueError("--moe-backend reference takes float weights; integer experts "
                             "(--quantization int8) run with grouped or auto")
        return ReferenceMoE()
    if choice == "triton" or (choice == "auto" and opts.kernels == "triton" and float_weights):
        if opts.kernels != "triton":
            raise ValueError("--moe-backend triton runs on CUDA with the triton attention "
                             "backend")
        if not float_weights:
            raise ValueError("--moe-backend triton takes float weights; integer experts run "
                             "with grouped or auto")
        return TritonMoE()
    if choice not in ("auto", "grouped"):
        raise ValueError(f"moe backend must be one of {', '.join(MOE_BACKENDS)}, got {choice!r}")
    return GroupedMoE(linear)


class MoE(nn.Module):
    """The MoE feed-forward of one decoder layer (checkpoint names: `gate`, `experts`,
    `shared_expert`, `shared_expert_gate`)."""

    def __init__(self, cfg: ModelConfig, opts: LayerOptions) -> None:
        super().__init__()
        moe, tp = cfg.moe, opts.tp
        self.moe, self.tp = moe, tp
        self.ep = opts.expert_parallel and tp.size > 1
        self.gate = Router(cfg.hidden_size, moe)
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, tp,
                               self.ep, moe)
        self.experts.method = moe_method_for(opts, moe)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_intermediate_size:
            # expert parallel: replicated, run on each rank's slice of the tokens
            self.shared_expert = GatedMLP(cfg.hidden_size, moe.shared_intermediate_size, opts,
                                          tp=SINGLE if self.ep else tp, reduce=False)
            if moe.shared_gate:
                self.shared_expert_gate = Linear(cfg.hidden_size, 1, False, DenseMethod())
        self.owner = self.firsts = None
        self.init_buffers("cpu")

    def init_buffers(self, device) -> None:
        self.counts = torch.zeros(self.moe.num_experts, dtype=torch.int64, device=device)
        if self.ep:       # expert -> the rank holding it; rank -> its first expert
            ranges = [expert_range(self.moe.num_experts, self.tp.size, r)
                      for r in range(self.tp.size)]
            self.owner = torch.cat([torch.full((n,), r, device=device)
                                    for r, (_, n) in enumerate(ranges)])
            self.firsts = torch.tensor([first for first, _ in ranges], device=device)

    def _shared(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.shared_expert is None:
            return None
        s = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            s = torch.sigmoid(self.shared_expert_gate(x)) * s
        return s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        flat = ids.flatten()
        self.counts.index_add_(0, flat, torch.ones_like(flat))
        if self.ep:
            return self._forward_ep(x, weights, ids)
        out = self.experts.method.apply(self.experts, x, weights, ids)
        shared = self._shared(x)
        if shared is not None:
            out = out + shared
        return self.tp.all_reduce(out)

    def _forward_ep(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                    ) -> torch.Tensor:
        tp, (t, k) = self.tp, ids.shape
        chunk = -(-t // tp.size)
        lo, hi = min(tp.rank * chunk, t), min((tp.rank + 1) * chunk, t)
        xs, ws, flat = x[lo:hi], weights[lo:hi], ids[lo:hi].flatten()    # my tokens
        dest = self.owner[flat]                                         # [n * k] their ranks
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=tp.size)
        recv_counts = torch.empty_like(send_counts)
        tp.all_to_all(recv_counts, send_counts)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        rows = xs[order // k]                                          # [n * k, H] by rank
        local_ids = flat[order] - self.firsts[dest[order]]             # ids at their rank
        got = x.new_empty(sum(recv), x.shape[1])
        got_ids = torch.empty(sum(recv), dtype=local_ids.dtype, device=x.device)
        tp.all_to_all(got, rows, recv, send)
        tp.all_to_all(got_ids, local_ids, recv, send)
        ones = torch.ones(got_ids.shape[0], 1, dtype=torch.float32, device=x.device)
        y = self.experts.method.apply(self.experts, got, ones, got_ids[:, None])
        back = x.new_empty(rows.shape)
        tp.all_to_all(back, y.contiguous(), send, recv)
        slots = torch.empty_like(back)
        slots[order] = back
        out = (slots.view(hi - lo, k, x.shape[1]) * ws.to(x.dtype)[..., None]).sum(1)
        shared = self._shared(xs)
        if shared is not None:
            out = out + shared
        padded = x.new_zeros(chunk, x.shape[1])
        padded[:hi - lo] = out
        return tp.all_gather(padded, dim=0)[:t]
