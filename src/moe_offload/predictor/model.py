"""The seq2seq expert-activation predictor: Linear -> Mamba2 -> Linear (SeqMoE §5.2) and its execution modes (§5.3).

The Mamba2 backbone is transformers' ``Mamba2Model`` (its pure-torch path on CPU, mamba-ssm / causal-conv1d
kernels when installed on a GPU), fed through ``inputs_embeds``; its recurrent state lives in a transformers
``DynamicCache``. A ``PredictorSet`` holds one predictor per MoE-layer range ``[l, l')``; each is triggered at
its range's last layer (default: two ranges, triggers at L/2 and L, §9.1).

Persistence: a directory with ``predictor.safetensors`` (weights, keys ``p{i}.*``) and ``predictor.json``
(format, version, model id and geometry, the ranges and sizes, training summary).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import MoeOffloadError
from .features import psi_topk
from .host_step import host_step_for
from .recurrent import block_step, conv_and_ssm_states
from .xl_weights import read_xl_weights

FORMAT = "moe-offload-predictor"
VERSION = 1
CONFIG_NAME = "predictor.json"
WEIGHTS_NAME = "predictor.safetensors"

# transformers logs a warning at the first use of each Mamba2 kernel that falls back to its torch reference path
# (expected on CPU, where mamba-ssm cannot be installed); keep those out of the user's output.
for _name in ("transformers.integrations.hub_kernels", "transformers.models.mamba2.modeling_mamba2"):
    logging.getLogger(_name).setLevel(logging.ERROR)


@dataclass
class PredictorSpec:
    """Geometry of one predictor.

    Attributes:
        layers: ``(l, l')``: the MoE layers ``[l, l')`` it reads and forecasts; it is triggered at layer ``l' - 1``.
        hidden_size: m, the Mamba2 hidden size (§5.2).
        num_mamba_layers: stacked Mamba2 blocks (the paper uses one backbone; 1 by default).
        state_size: SSM state size per head (N).
        head_dim: Mamba2 head dimension; heads = 2 * m / head_dim (expand 2).
        conv_kernel: width of Mamba2's causal convolution.
        chunk_size: chunk length of the parallel (training / prefill) scan.
        input_skip: add a learned per-feature gain times the input's active-expert mask to the output logits
            (``A' = Linear(Z2) + g * [A > 0]``). Not in the paper: routing on our testbeds is sticky across steps
            (the previous step's experts alone reach ~85% top-(k+3) recall), and the Linear(n*e -> m) bottleneck
            otherwise spends its capacity re-encoding the current set; with the skip the backbone learns what
            changes. The skip reads the mask, not the Psi values: with the values, recursive prediction fed
            Psi(own output) (non-uniform over the predicted top-k) back through the gain and collapsed onto one
            expert per layer within three steps. ``False`` gives the paper's exact architecture.
    """

    layers: tuple[int, int]
    hidden_size: int = 128
    num_mamba_layers: int = 1
    state_size: int = 64
    head_dim: int = 32
    conv_kernel: int = 4
    chunk_size: int = 64
    input_skip: bool = True

    def __post_init__(self):
        self.layers = (int(self.layers[0]), int(self.layers[1]))
        if not 0 <= self.layers[0] < self.layers[1]:
            raise MoeOffloadError(f"bad predictor layer range {self.layers}")
        if (2 * self.hidden_size) % self.head_dim:
            raise MoeOffloadError(f"hidden size {self.hidden_size}: 2 * m must be a multiple of "
                                  f"head_dim {self.head_dim}")

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def trigger_layer(self) -> int:
        return self.layers[1] - 1


def default_ranges(num_moe_layers: int, num_predictors: int = 2) -> list[tuple[int, int]]:
    """Contiguous ranges splitting ``[0, L)`` into ``num_predictors`` near-equal parts (triggers at L/2, L for two).

    Raises:
        MoeOffloadError: if ``num_predictors`` is not in ``[1, L]``.
    """
    if not 1 <= num_predictors <= num_moe_layers:
        raise MoeOffloadError(f"--predictors must be between 1 and the {num_moe_layers} MoE layers, "
                              f"got {num_predictors}")
    cuts = [round(i * num_moe_layers / num_predictors) for i in range(num_predictors + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(num_predictors)]


class SeqPredictor(nn.Module):
    """One seq2seq predictor for MoE layers ``[l, l')`` with e experts each (SeqMoE §5.2):
    ``Z1 = Linear(A)``, ``Z2, H = Mamba2(Z1, H)``, ``A' = Linear(Z2)`` (+ ``g * [A > 0]`` with ``spec.input_skip``).

    Input: Psi features, float32 ``[B, T, n * e]``; output: logits float32 ``[B, T, n, e]`` where position t
    forecasts the activation of the step after input t (softmax over e gives per-layer probabilities).
    """

    def __init__(self, spec: PredictorSpec, num_experts: int, top_k: int):
        super().__init__()
        from transformers import Mamba2Config
        from transformers.models.mamba2.modeling_mamba2 import Mamba2Model

        self.spec, self.num_experts, self.top_k = spec, num_experts, top_k
        feat = spec.num_layers * num_experts
        m = spec.hidden_size
        cfg = Mamba2Config(vocab_size=1, hidden_size=m, num_hidden_layers=spec.num_mamba_layers,
                           state_size=spec.state_size, expand=2, head_dim=spec.head_dim,
                           num_heads=2 * m // spec.head_dim, n_groups=1, conv_kernel=spec.conv_kernel,
                           chunk_size=spec.chunk_size, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                           use_cache=True)
        self.inp = nn.Linear(feat, m)
        self.backbone = Mamba2Model(cfg)
        self.out = nn.Linear(m, feat)
        # initial gain: an active expert starts 2 logits above an inactive one, i.e. near "persistence"
        self.skip = nn.Parameter(torch.full((feat,), 2.0)) if spec.input_skip else None

    def _apply(self, fn, *args, **kwargs):
        self.__dict__.pop("_host_step", None)   # numpy views of the parameters (predictor.host_step) go stale
        return super()._apply(fn, *args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        self.__dict__.pop("_host_step", None)
        return super().load_state_dict(*args, **kwargs)

    def forward(self, x: torch.Tensor, cache=None, use_cache: bool = False):
        """Run over a sequence. ``x [B, T, n*e]`` float32 -> ``(logits [B, T, n, e], cache)``; with
        ``use_cache`` (or a ``cache`` to continue) the recurrent state after the last position is returned."""
        z = self.backbone(inputs_embeds=self.inp(x), cache=cache, use_cache=use_cache or cache is not None)
        return self._head(z.last_hidden_state, x), z.cache

    def _head(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = self.out(z)
        if self.skip is not None:
            y = y + self.skip * (x > 0).to(y.dtype)
        return y.view(*y.shape[:-1], self.spec.num_layers, self.num_experts)

    # --- execution modes (§5.3); batch size 1 at inference -------------------------------------------------
    def prefill(self, x: torch.Tensor):
        """Prefill: consume the prompt's activations ``x [P, n*e]``; return ``(logits [n, e]`` forecasting step
        P, i.e. the first decode step, ``state)``."""
        logits, cache = self.forward(x.unsqueeze(0), use_cache=True)
        return logits[0, -1], cache

    def step(self, x: torch.Tensor, state):
        """One-step prediction: consume one step's activation ``x [n*e]`` (advancing ``state`` in place); return
        ``logits [n, e]`` for the next step.

        Runs each Mamba2 block's recurrent update directly on the cache's tensors (``predictor.recurrent``: the
        computation of ``forward(x, cache=state)`` to float32 rounding, which a test checks, without the generic
        path's overhead: this runs every decode step); a float32 predictor on the CPU runs it in numpy
        (``predictor.host_step``: torch's per-operator dispatch cost more than the arithmetic)."""
        hs = host_step_for(self, x)
        if hs is not None:
            return torch.from_numpy(hs.step(x.detach().reshape(-1).numpy(), hs.states(state)))
        x = x.view(1, -1)
        h = self.inp(x)
        for i, block in enumerate(self.backbone.layers):
            h = block_step(block, h, *conv_and_ssm_states(state, i))
        return self._head(self.backbone.norm_f(h), x)[0]

    def rollout(self, first: torch.Tensor, state, steps: int) -> torch.Tensor:
        """Recursive prediction (§5.3): starting from the one-step prediction ``first [n, e]`` (logits), feed
        ``Psi(own output)`` back ``steps`` times; the recurrent state is restored afterwards, so the next one-step
        prediction is unaffected.

        Returns:
            float32 logits ``[steps, n, e]``: row j forecasts the step ``j + 2`` after the last consumed input
            (``first`` forecasts step 1).
        """
        hs = host_step_for(self, first)
        if hs is not None:
            return torch.from_numpy(hs.rollout(first.detach().numpy(), hs.states(state), steps))
        snap = snapshot_state(state)
        outs = []
        cur = first
        try:
            for _ in range(steps):
                cur = self.step(psi_topk(cur, self.top_k), state)
                outs.append(cur)
        finally:
            restore_state(state, snap)
        if not outs:
            return first.new_zeros(0, *first.shape)
        return torch.stack(outs)


def snapshot_state(cache) -> list[tuple[dict, dict]]:
    """Copies of a Mamba2 ``DynamicCache``'s per-layer conv and recurrent state tensors."""
    return [({k: v.clone() for k, v in lay.conv_states.items()},
             {k: v.clone() for k, v in lay.recurrent_states.items()}) for lay in cache.layers]


def restore_state(cache, snap) -> None:
    """Write a ``snapshot_state`` back into the same cache tensors (in place, so references stay valid)."""
    for lay, (conv, rec) in zip(cache.layers, snap):
        for k, v in conv.items():
            lay.conv_states[k].copy_(v)
        for k, v in rec.items():
            lay.recurrent_states[k].copy_(v)


@dataclass
class PredictorHeader:
    """What a saved predictor set is for (``predictor.json``)."""

    model_id: str
    model_type: str
    num_moe_layers: int
    num_experts: int
    top_k: int
    specs: list[PredictorSpec]
    shuffled_control: bool = False
    training: dict = field(default_factory=dict)
    # [L][E] expert token counts over the training requests' prefills (SeqMoE §8.4's offline popularity profile)
    prefill_popularity: list | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        d["specs"] = [asdict(s) | {"layers": list(s.layers)} for s in self.specs]
        return {"format": FORMAT, "version": VERSION} | d


class PredictorSet(nn.Module):
    """The predictors of one model: ``predictors[i]`` owns ``header.specs[i].layers`` (SeqMoE §5.2, §9.1)."""

    def __init__(self, header: PredictorHeader):
        super().__init__()
        self.header = header
        covered = sorted(s.layers for s in header.specs)
        for (a, b), (c, d) in zip(covered, covered[1:]):
            if c < b:
                raise MoeOffloadError(f"predictor layer ranges overlap: {(a, b)} and {(c, d)}")
        if covered and covered[-1][1] > header.num_moe_layers:
            raise MoeOffloadError(f"predictor range {covered[-1]} exceeds the model's "
                                  f"{header.num_moe_layers} MoE layers")
        self.predictors = nn.ModuleList(SeqPredictor(s, header.num_experts, header.top_k) for s in header.specs)
        #: the ``seqmoe-xl`` blend weights per layer distance calibrated for this predictor (``xl_weights.json``,
        #: ``predictor.xl_calibrate``), or None: ``predictor.xl_weights.XL_WEIGHTS``
        self.xl_weights: tuple[float, ...] | None = None
        self.xl_weights_note: str | None = None          # where they come from (``describe_xl_weights``)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def parameter_bytes(self) -> int:
        """Bytes of all predictor weights (float32 unless converted)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def state_bytes(self) -> int:
        """Bytes of the recurrent state one request keeps (float32): per Mamba2 layer the causal-conv window
        ``[conv_dim, conv_kernel]`` with ``conv_dim = 2m + 2N`` and the SSM state ``[heads, head_dim, N]``
        (``heads * head_dim = 2m``). Recursive rollout temporarily doubles it (the snapshot)."""
        total = 0
        for p in self.predictors:
            s = p.spec
            per_layer = (2 * s.hidden_size + 2 * s.state_size) * s.conv_kernel + 2 * s.hidden_size * s.state_size
            total += 4 * per_layer * s.num_mamba_layers
        return total

    def save(self, out: str | Path) -> Path:
        """Write ``predictor.safetensors`` + ``predictor.json`` into directory ``out`` (created if needed).

        Raises:
            MoeOffloadError: if ``out`` exists and is not a directory, or already holds a predictor (never
                overwritten), or cannot be written.
        """
        from safetensors.torch import save_file

        d = Path(out)
        if d.exists() and not d.is_dir():
            raise MoeOffloadError(f"--out {d} exists and is not a directory")
        if (d / CONFIG_NAME).exists() or (d / WEIGHTS_NAME).exists():
            raise MoeOffloadError(f"{d} already holds a predictor; choose another --out (nothing was overwritten)")
        try:
            d.mkdir(parents=True, exist_ok=True)
            tensors = {f"p{i}.{k}": v.detach().contiguous().cpu() for i, p in enumerate(self.predictors)
                       for k, v in p.state_dict().items()}
            save_file(tensors, str(d / WEIGHTS_NAME))
            (d / CONFIG_NAME).write_text(json.dumps(self.header.to_json(), indent=1) + "\n")
        except OSError as e:
            raise MoeOffloadError(f"cannot write predictor to {d}: {e.strerror or e}") from None
        return d


def load_predictor(path: str | Path, model_id: str | None = None, device: str | torch.device = "cpu") -> PredictorSet:
    """Load a predictor set written by ``PredictorSet.save``.

    Args:
        path: the predictor directory.
        model_id: if given, the fingerprint of the model it will run with (``models.checkpoint.checkpoint_model_id``).
        device: where to put it.

    The calibrated ``seqmoe-xl`` blend weights stored beside it, if any, become ``xl_weights``.

    Raises:
        MoeOffloadError: missing/corrupt files (the blend weights' included), another format, or a predictor
            trained for another model.
    """
    from safetensors.torch import load_file

    d = Path(path)
    cfg_p, w_p = d / CONFIG_NAME, d / WEIGHTS_NAME
    if not cfg_p.is_file() or not w_p.is_file():
        raise MoeOffloadError(f"{d} is not a predictor directory (needs {CONFIG_NAME} and {WEIGHTS_NAME})")
    try:
        j = json.loads(cfg_p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MoeOffloadError(f"{cfg_p}: unreadable predictor config ({e})") from None
    if not isinstance(j, dict) or j.get("format") != FORMAT or j.get("version") != VERSION:
        raise MoeOffloadError(f"{cfg_p}: not a moe-offload predictor v{VERSION}")
    try:
        specs = [PredictorSpec(**{**s, "layers": tuple(s["layers"])}) for s in j["specs"]]
        header = PredictorHeader(model_id=j["model_id"], model_type=j["model_type"],
                                 num_moe_layers=int(j["num_moe_layers"]), num_experts=int(j["num_experts"]),
                                 top_k=int(j["top_k"]), specs=specs, shuffled_control=bool(j.get("shuffled_control")),
                                 training=j.get("training", {}),
                                 prefill_popularity=j.get("prefill_popularity"))
    except (KeyError, TypeError, ValueError) as e:
        raise MoeOffloadError(f"{cfg_p}: malformed predictor config ({e})") from None
    if model_id is not None and header.model_id != model_id:
        raise MoeOffloadError(f"predictor {d} was trained for model {header.model_id}, not {model_id}")
    pset = PredictorSet(header)
    try:
        tensors = load_file(str(w_p))
    except Exception as e:
        raise MoeOffloadError(f"{w_p}: unreadable predictor weights ({e})") from None
    for i, p in enumerate(pset.predictors):
        sd = {k[len(f"p{i}."):]: v for k, v in tensors.items() if k.startswith(f"p{i}.")}
        try:
            p.load_state_dict(sd, strict=True)
        except RuntimeError as e:
            raise MoeOffloadError(f"{w_p}: weights do not match {cfg_p} ({str(e).splitlines()[0]})") from None
    stored = read_xl_weights(d)
    if stored is not None:
        pset.xl_weights, pset.xl_weights_note = stored
    return pset.to(device).eval()
