"""Model configuration of Llama-family decoders (Llama 2/3, Mistral, Qwen2) and RoPE frequencies.

:class:`ModelConfig` is read from a Hugging Face ``config.json`` (both the transformers v4 layout,
``rope_theta`` + ``rope_scaling``, and the v5 layout, ``rope_parameters``) or taken from a preset
(:data:`PRESETS`) for random-weight runs.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

__all__ = ["ModelConfig", "PRESETS", "ARCHITECTURES", "load_config"]

#: ``model_type`` values of config.json this engine runs.
ARCHITECTURES = ("llama", "mistral", "qwen2")
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family decoder.

    Attributes
    ----------
    arch : {"llama", "mistral", "qwen2"}
    vocab_size, hidden_size, intermediate_size, num_layers : int
    num_heads, num_kv_heads, head_dim : int
        Query heads, KV heads (GQA when fewer) and the per-head dimension.
    rms_norm_eps : float
    rope_theta : float
    rope_scaling : dict or None
        ``{"rope_type": "linear" | "llama3", "factor": ..., ...}`` (HF's keys); None for plain RoPE.
    max_position_embeddings : int
    tie_word_embeddings : bool
        The LM head reuses the embedding matrix.
    qkv_bias, o_bias, mlp_bias : bool
        Bias vectors of the q/k/v, o and MLP projections (Qwen2 has q/k/v biases).
    sliding_window : int or None
        Mistral / Qwen2 sliding-window size; paths longer than it are refused.
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
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling)

    # ------------------------------------------------------------------ derived
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count (embeddings and LM head counted once each unless tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        per_layer = attn + 3 * h * i + 2 * h
        return self.num_layers * per_layer + v * h * (1 if self.tie_word_embeddings else 2) + h

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies, float32 ``[head_dim // 2]``, computed as transformers does."""
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        rs = self.rope_scaling
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
        """Parse a Hugging Face ``config.json`` dict; ValueError naming the bad or missing key."""
        if not isinstance(cfg, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
        arch = cfg.get("model_type")
        if arch not in ARCHITECTURES:
            raise ValueError(f"{where}: unsupported model_type {arch!r}; this engine runs "
                             f"{', '.join(ARCHITECTURES)} decoders")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in cfg]
        if missing:
            raise ValueError(f"{where}: missing required key(s) {missing}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{where}: hidden_act {act!r} is not supported (SwiGLU with silu only)")
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        hidden = cfg["hidden_size"]
        shaped = isinstance(hidden, int) and isinstance(heads, int) and heads > 0
        head_dim = cfg.get("head_dim") or (hidden // heads if shaped else 0)
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        scaling = rope if _rope_type(rope) != "default" else None
        legacy = cfg.get("rope_scaling")
        if legacy and _rope_type(legacy) != "default":
            scaling = dict(legacy)
        if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ValueError(f"{where}: partial rotary embeddings are not supported")
        window = cfg.get("sliding_window")
        if arch == "qwen2" and not cfg.get("use_sliding_window", False):
            window = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [] if eos is None else [eos]))
        try:
            return cls(
                arch=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
                num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
                rope_scaling=scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
                o_bias=arch == "llama" and bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                sliding_window=int(window) if window else None,
                bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
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
