"""Model configuration of the decoders the engine runs (Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 3
text) and RoPE frequencies.

:class:`ModelConfig` is read from a Hugging Face ``config.json`` (both the transformers v4 layout,
``rope_theta`` + ``rope_scaling``, and the v5 layout, ``rope_parameters``) or taken from a preset
(:data:`PRESETS`) for random-weight runs. Everything a config asks for that the engine does not
implement (mixture-of-experts layers, unknown RoPE scaling, logit soft-capping, ...) is refused
here, naming it, before any weight is read.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

__all__ = ["ModelConfig", "PRESETS", "ARCHITECTURES", "LAYER_TYPES", "load_config"]

#: ``model_type`` values of config.json this engine runs (``gemma3``, the multimodal Gemma 3, runs
#: as its ``gemma3_text`` language model).
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
#: ``layer_types`` entries: attention over the whole path, or over its last ``sliding_window`` tokens.
LAYER_TYPES = ("full_attention", "sliding_attention")
_ROPE_TYPES = ("default", "linear", "llama3")
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
# transformers' Gemma3TextConfig defaults: Gemma 3 config.json files (the multimodal ones' text_config
# above all) leave out every key at its default
_GEMMA3_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "tie_word_embeddings": True,
    "bos_token_id": 2, "eos_token_id": 1,
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of a decoder.

    Attributes
    ----------
    arch : {"llama", "mistral", "qwen2", "qwen3", "gemma3_text"}
        ``gemma3_text``: RMSNorms scale by ``1 + w`` (in float32), every sub-layer's output is
        normed before its residual add, the embeddings are scaled by ``sqrt(hidden_size)``.
    vocab_size, hidden_size, intermediate_size, num_layers : int
    num_heads, num_kv_heads, head_dim : int
        Query heads, KV heads (GQA when fewer) and the per-head dimension.
    rms_norm_eps : float
    rope_theta : float
    rope_scaling : dict or None
        ``{"rope_type": "linear" | "llama3", "factor": ..., ...}`` (HF's keys); None for plain RoPE.
    local_rope_theta : float or None
        RoPE base of the sliding-window layers when it differs from the others' (Gemma 3).
    local_rope_scaling : dict or None
        Their RoPE scaling (only with ``local_rope_theta``).
    max_position_embeddings : int
    tie_word_embeddings : bool
        The LM head reuses the embedding matrix.
    qkv_bias, o_bias, mlp_bias : bool
        Bias vectors of the q/k/v, o and MLP projections (Qwen2 has q/k/v biases).
    hidden_act : {"silu", "gelu_pytorch_tanh"}
        The gated MLP's activation (SwiGLU or GeGLU with tanh-approximated GELU).
    qk_norm : bool
        RMSNorm of every query and key head before RoPE (Qwen3, Gemma 3).
    sliding_window : int or None
        Tokens a sliding-window layer's query sees: the last ``sliding_window`` of its path, its
        own included.
    layer_types : tuple of str
        ``"full_attention"`` or ``"sliding_attention"`` per layer (:data:`LAYER_TYPES`); default:
        every layer sliding when ``sliding_window`` is set, else full.
    query_pre_attn_scalar : float or None
        Attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` instead of
        ``head_dim ** -0.5`` (Gemma 3).
    language_model : bool
        The weights are the language model's inside a multimodal checkpoint (Gemma 3).
    bos_token_id : int or None
    eos_token_ids : tuple of int
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple = ()
    hidden_act: str = "silu"
    qk_norm: bool = False
    layer_types: tuple = ()
    local_rope_theta: float | None = None
    local_rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    query_pre_attn_scalar: float | None = None
    language_model: bool = False

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.arch!r}; expected one of {ARCHITECTURES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model config: {name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_attention_heads ({self.num_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_kv_heads})")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError("model config: rms_norm_eps and rope_theta must be positive")
        for rs in (self.rope_scaling, self.local_rope_scaling):
            if rs is not None:
                _check_rope_scaling(rs)
        if self.local_rope_scaling is not None and self.local_rope_theta is None:
            raise ValueError("model config: local_rope_scaling needs local_rope_theta")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"model config: hidden activation {self.hidden_act!r} is not supported; "
                             f"expected one of {_ACTIVATIONS}")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool)
                                                or not isinstance(self.sliding_window, int)
                                                or self.sliding_window < 1):
            raise ValueError(f"model config: sliding_window must be a positive integer or None, got "
                             f"{self.sliding_window!r}")
        types = tuple(self.layer_types) or (
            ("sliding_attention" if self.sliding_window else "full_attention",) * self.num_layers)
        object.__setattr__(self, "layer_types", types)    # (frozen: the default is filled in here)
        if len(types) != self.num_layers or not set(types) <= set(LAYER_TYPES):
            raise ValueError(f"model config: layer_types must give one of {LAYER_TYPES} for each of "
                             f"the {self.num_layers} layers, got {list(types)}")
        if "sliding_attention" in types and self.sliding_window is None:
            raise ValueError("model config: layer_types has sliding_attention layers but there is no "
                             "sliding_window")
        if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
            raise ValueError("model config: query_pre_attn_scalar must be positive")

    # ------------------------------------------------------------------ derived
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def gemma(self) -> bool:
        """Gemma-style layers: ``1 + w`` norms, norms after attention and MLP, scaled embeddings."""
        return self.arch == "gemma3_text"

    @property
    def sm_scale(self) -> float:
        """The attention scores' scale."""
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None
                else self.head_dim) ** -0.5

    @property
    def embed_scale(self) -> float | None:
        """Factor of the embeddings (``sqrt(hidden_size)`` for Gemma), None when there is none."""
        return self.hidden_size ** 0.5 if self.gemma else None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, None for a full-attention layer."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def local_rope(self, layer: int) -> bool:
        """Whether ``layer`` uses the local RoPE (:attr:`local_rope_theta`)."""
        return self.local_rope_theta is not None and self.layer_types[layer] == "sliding_attention"

    def num_parameters(self) -> int:
        """Parameter count (embeddings and LM head counted once each unless tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        norms = (4 if self.gemma else 2) * h + (2 * self.head_dim if self.qk_norm else 0)
        per_layer = attn + 3 * h * i + norms
        return self.num_layers * per_layer + v * h * (1 if self.tie_word_embeddings else 2) + h

    def inv_freq(self, *, local: bool = False) -> torch.Tensor:
        """RoPE inverse frequencies, float32 ``[head_dim // 2]``, computed as transformers does;
        ``local``: those of the sliding-window layers (:attr:`local_rope_theta`)."""
        dim = self.head_dim
        theta, rs = ((self.local_rope_theta, self.local_rope_scaling) if local and self.local_rope_theta
                     else (self.rope_theta, self.rope_scaling))
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        kind = _rope_type(rs) if rs else "default"
        if kind == "linear":
            inv = inv / float(rs["factor"])
        elif kind == "llama3":
            factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
            old = float(rs["original_max_position_embeddings"])
            low_wavelen, high_wavelen = old / lo, old / hi
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old / wavelen - lo) / (hi - lo)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            inv = torch.where(medium, smoothed, scaled)
        return inv

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf(cls, cfg: dict, where: str = "config.json") -> "ModelConfig":
        """Parse a Hugging Face ``config.json`` dict; ValueError naming the bad or missing key, or
        what the engine does not support."""
        if not isinstance(cfg, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
        arch = cfg.get("model_type")
        language_model = arch == "gemma3"
        if language_model:
            cfg = _gemma3_text_config(cfg, where)
            arch = "gemma3_text"
        if arch not in ARCHITECTURES:
            raise ValueError(f"{where}: unsupported model_type {arch!r}; this engine runs "
                             f"{', '.join(ARCHITECTURES)} (and gemma3's text model) decoders")
        moe = [k for k in _MOE_KEYS if cfg.get(k)]
        if moe:
            raise ValueError(f"{where}: mixture-of-experts layers ({moe[0]}={cfg[moe[0]]!r}) are not "
                             "supported; this engine runs dense decoders")
        gemma = arch == "gemma3_text"
        if gemma:
            cfg = {**_GEMMA3_DEFAULTS, **cfg}
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key) is not None:
                raise ValueError(f"{where}: {key}={cfg[key]!r} is not supported")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError(f"{where}: use_bidirectional_attention is not supported (causal decoders only)")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in cfg]
        if missing:
            raise ValueError(f"{where}: missing required key(s) {missing}")
        act_key = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
        act = cfg.get(act_key, "silu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"{where}: {act_key} {act!r} is not supported (gated MLPs with "
                             f"{' or '.join(_ACTIVATIONS)} only)")
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        hidden = cfg["hidden_size"]
        shaped = isinstance(hidden, int) and isinstance(heads, int) and heads > 0
        head_dim = cfg.get("head_dim") or (hidden // heads if shaped else 0)
        theta, scaling, local_theta, local_scaling = _rope_config(cfg, gemma, where)
        window = cfg.get("sliding_window")
        if arch == "llama" or (arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False)):
            window = None
        types = cfg.get("layer_types")
        layers = cfg["num_hidden_layers"]
        if window is None:
            types = None
        elif types is None and isinstance(layers, int):
            # as transformers fills them in: Qwen slides from max_window_layers on, Gemma 3 has a
            # global layer every sliding_window_pattern layers, Mistral slides everywhere
            if arch in ("qwen2", "qwen3"):
                first = cfg.get("max_window_layers", 28)
                types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
            elif gemma:
                every = cfg.get("sliding_window_pattern", 6)
                types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
        attn_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [] if eos is None else [eos]))
        try:
            return cls(
                arch=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"], num_layers=layers,
                num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
                rope_scaling=scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=arch == "qwen2" or attn_bias,
                o_bias=arch in ("llama", "qwen3", "gemma3_text") and attn_bias,
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                sliding_window=int(window) if window else None,
                bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
                hidden_act=act, qk_norm=arch in ("qwen3", "gemma3_text"),
                layer_types=tuple(types or ()),
                local_rope_theta=float(local_theta) if local_theta is not None else None,
                local_rope_scaling=local_scaling,
                query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]) if gemma else None,
                language_model=language_model,
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        """A preset shape from :data:`PRESETS` (``"tiny"``, ``"llama3-8b"``, ...)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
        return PRESETS[name]

    def with_eos(self, eos_token_ids) -> "ModelConfig":
        return replace(self, eos_token_ids=tuple(int(e) for e in eos_token_ids))


def _gemma3_text_config(cfg: dict, where: str) -> dict:
    """The ``text_config`` of a multimodal Gemma 3 ``config.json`` (the language model), with the
    top level's token ids where it has none."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{where}: a gemma3 config without a text_config object; only the Gemma 3 "
                         "language model is supported")
    text = dict(text)
    kind = text.setdefault("model_type", "gemma3_text")
    if kind != "gemma3_text":
        raise ValueError(f"{where}: gemma3 text_config has model_type {kind!r}; expected gemma3_text")
    for key in ("eos_token_id", "bos_token_id"):
        if cfg.get(key) is not None:
            text[key] = cfg[key]
    return text


def _rope_config(cfg: dict, gemma: bool, where: str) -> tuple:
    """``(theta, scaling, local_theta, local_scaling)`` of a config.json: the v5 ``rope_parameters``
    (per layer type for Gemma 3) or the v4 keys (Gemma 3's ``rope_local_base_freq``)."""
    params = cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{where}: rope_parameters must be an object")
    per_type = set(params) & set(LAYER_TYPES)
    if per_type:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention")
    else:
        full, local = params, None
    full = dict(full)
    theta = full.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    scaling = full if _rope_type(full) != "default" else None
    legacy = cfg.get("rope_scaling")
    if legacy and _rope_type(legacy) != "default":
        scaling = dict(legacy)
    local_theta = local_scaling = None
    if local is not None:
        local = dict(local)
        local_theta = local.pop("rope_theta", None) or cfg.get("rope_local_base_freq", 10000.0)
        local_scaling = local if _rope_type(local) != "default" else None
    elif gemma:
        local_theta = cfg.get("rope_local_base_freq", 10000.0)
    partial = [p.get("partial_rotary_factor", 1.0) for p in (full, local or {})]
    if any(float(p) != 1.0 for p in partial + [cfg.get("partial_rotary_factor", 1.0)]):
        raise ValueError(f"{where}: partial rotary embeddings are not supported")
    return theta, scaling, local_theta, local_scaling


def _rope_type(rs: dict) -> str:
    return rs.get("rope_type", rs.get("type", "default")) if rs else "default"


def _check_rope_scaling(rs: dict) -> None:
    kind = _rope_type(rs)
    if kind not in _ROPE_TYPES:
        raise ValueError(f"model config: RoPE scaling type {kind!r} is not supported; expected one of "
                         f"{_ROPE_TYPES}")
    need = {"linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "default": ()}[kind]
    missing = [k for k in need if k not in rs]
    if missing:
        raise ValueError(f"model config: {kind} RoPE scaling lacks {missing}")


def load_config(model_dir) -> ModelConfig:
    """:class:`ModelConfig` of a Hugging Face model directory (``config.json`` and, when present,
    the EOS ids of ``generation_config.json``).

    Raises
    ------
    FileNotFoundError
        If the directory or its ``config.json`` does not exist.
    ValueError
        If ``config.json`` is not valid JSON or describes an unsupported model.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face model directory)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: invalid JSON ({e})") from None
    config = ModelConfig.from_hf(cfg, str(cfg_path))
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        try:
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError):
            eos = None
        if eos is not None:
            config = config.with_eos(eos if isinstance(eos, list) else [eos])
    return config


PRESETS = {
    # 2 layers, hidden 64, GQA 4: the CPU test / demo model
    "tiny": ModelConfig(arch="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6,
                        max_position_embeddings=65536),
    # 2 layers, head_dim 64, GQA 4: the demo model (big enough heads for the planners' choices)
    "small": ModelConfig(arch="llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                         num_heads=8, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
                         max_position_embeddings=65536),
    # Meta-Llama-3-8B (the DeFT benchmark model), with Llama-3.1's RoPE scaling
    "llama3-8b": ModelConfig(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                             rope_theta=500000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192},
                             max_position_embeddings=131072, bos_token_id=128000,
                             eos_token_ids=(128001,)),
}
