"""Model weights: Hugging Face safetensors checkpoints (never pickle), random weights of a preset
shape built directly on the target device, and the tokenizer of a model directory.

The q/k/v projections are fused into one ``[q + 2 kv, hidden]`` matrix and gate/up into one
``[2 intermediate, hidden]`` matrix at load time. Gemma's RMSNorm weights ``w`` are stored as the
float32 factors ``1 + w`` its norms multiply by.

Under tensor parallelism (a :class:`~treeattn.engine.parallel.TensorParallel`) a rank reads only
its share of each matrix from the safetensors files (``get_slice``), so no rank ever holds the
whole model: see :mod:`treeattn.engine.parallel` for the layout.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from treeattn.engine.config import ModelConfig

__all__ = ["LayerWeights", "Weights", "load_weights", "random_weights", "load_tokenizer"]

log = logging.getLogger(__name__)


@dataclass
class LayerWeights:
    """One decoder layer; matrices are ``[out_features, in_features]`` like ``nn.Linear``.

    The shapes below are the whole model's; each rank of a tensor-parallel group of ``T`` holds
    ``1 / T`` of the heads in ``qkv`` (of q, k and v each) and ``o``'s matching columns, ``1 / T``
    of the intermediate features in ``gate_up`` (of gate and up each) and ``down``'s matching
    columns, and ``o_bias`` and ``down_bias`` on TP rank 0 only (None elsewhere).

    Attributes
    ----------
    qkv : [q_size + 2 * kv_size, hidden]
    qkv_bias : [q_size + 2 * kv_size] or None
    o : [hidden, q_size]
    o_bias : [hidden] or None
    gate_up : [2 * intermediate, hidden]
    gate_up_bias : [2 * intermediate] or None
    down : [hidden, intermediate]
    down_bias : [hidden] or None
    attn_norm, mlp_norm : [hidden]
        RMSNorm weights before attention and before the MLP.
    q_norm, k_norm : [head_dim] or None
        RMSNorm weights of every query / key head (Qwen3, Gemma 3).
    attn_out_norm, mlp_out_norm : [hidden] or None
        RMSNorm weights of the attention and MLP outputs before their residual adds (Gemma 3).
    """

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None


#: HF names of the norms (below ``model.layers.{i}.``): Gemma's post_attention_layernorm normalises
#: the attention output, its pre_feedforward_layernorm is the MLP's input norm
_NORMS = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight"}
_GEMMA_NORMS = {"attn_norm": "input_layernorm.weight", "attn_out_norm": "post_attention_layernorm.weight",
                "mlp_norm": "pre_feedforward_layernorm.weight", "mlp_out_norm": "post_feedforward_layernorm.weight"}
_NORM_KEYS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm")


@dataclass
class Weights:
    """All weights: ``embed [vocab, hidden]``, ``layers``, ``norm [hidden]``, ``lm_head [vocab, hidden]``
    (the embedding itself when tied). Each rank of a tensor-parallel group of ``T`` holds
    ``vocab / T`` rows of ``embed`` and ``lm_head``: its slice of the vocabulary."""

    embed: torch.Tensor
    layers: list
    norm: torch.Tensor
    lm_head: torch.Tensor


def _prefixes(config: ModelConfig, names) -> tuple[str, str]:
    """``(model, lm_head)`` name prefixes: ``model.`` and none, or those of a multimodal
    checkpoint's language model (transformers v5's ``model.language_model.`` or v4's
    ``language_model.model.``)."""
    if not config.language_model:
        return "model.", ""
    if "language_model.model.embed_tokens.weight" in names:
        return "language_model.model.", "language_model."
    return "model.language_model.", ""


def _hf_names(config: ModelConfig, i: int, prefix: str = "model.") -> dict:
    p = f"{prefix}layers.{i}."
    names = {k: p + v for k, v in {
        "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
        "o": "self_attn.o_proj.weight", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
        "down": "mlp.down_proj.weight", **(_GEMMA_NORMS if config.gemma else _NORMS)}.items()}
    if config.qk_norm:
        names.update(q_norm=p + "self_attn.q_norm.weight", k_norm=p + "self_attn.k_norm.weight")
    if config.qkv_bias:
        names.update(qb=p + "self_attn.q_proj.bias", kb=p + "self_attn.k_proj.bias",
                     vb=p + "self_attn.v_proj.bias")
    if config.o_bias:
        names["ob"] = p + "self_attn.o_proj.bias"
    if config.mlp_bias:
        names.update(gateb=p + "mlp.gate_proj.bias", upb=p + "mlp.up_proj.bias",
                     downb=p + "mlp.down_proj.bias")
    return names


def _expected_shapes(config: ModelConfig, prefix: str = "model.", head_prefix: str = "") -> dict:
    h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    shapes = {f"{prefix}embed_tokens.weight": (config.vocab_size, h), f"{prefix}norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes[f"{head_prefix}lm_head.weight"] = (config.vocab_size, h)
    d = config.head_dim
    per = {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (i, h), "up": (i, h),
           "down": (h, i), "attn_norm": (h,), "mlp_norm": (h,), "attn_out_norm": (h,), "mlp_out_norm": (h,),
           "q_norm": (d,), "k_norm": (d,), "qb": (q,), "kb": (kv,), "vb": (kv,),
           "ob": (h,), "gateb": (i,), "upb": (i,), "downb": (h,)}
    for layer in range(config.num_layers):
        for key, name in _hf_names(config, layer, prefix).items():
            shapes[name] = per[key]
    return shapes


def _checkpoint_files(path: Path) -> dict:
    """Map tensor name -> safetensors file of a model directory (sharded or not)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: malformed safetensors index ({type(e).__name__}: {e})") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: 'weight_map' must map tensor names to shard files")
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise FileNotFoundError(f"{index} names shard {shard!r}, which does not exist in {path}")
        return {name: path / shard for name, shard in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for ext in ("*.bin", "*.pt", "*.pth", "*.ckpt") for p in path.glob(ext))
        if pickled:
            raise ValueError(f"{path}: only pickled checkpoints {pickled} found; treeattn loads "
                             "safetensors only and never unpickles (re-save the model with "
                             "save_pretrained(..., safe_serialization=True))")
        raise FileNotFoundError(f"{path}: no *.safetensors weights and no model.safetensors.index.json")
    from safetensors import safe_open

    names = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                names[name] = f
    return names


def _tp_parts(config: ModelConfig, tp, prefix: str, head_prefix: str) -> dict:
    """The part of each split checkpoint tensor a tensor-parallel rank reads, as an index of its
    ``get_slice``: rows of the column-parallel matrices (q/k/v, gate/up, their biases, the
    embedding and the LM head), columns of the row-parallel ones (o, down). Tensors not named
    here are read whole."""
    def rows(n):
        return (tp.part(n),)

    def cols(n):
        return (slice(None), tp.part(n))

    q, kv, i, vocab = config.q_size, config.kv_size, config.intermediate_size, config.vocab_size
    per = {"q": rows(q), "k": rows(kv), "v": rows(kv), "qb": rows(q), "kb": rows(kv), "vb": rows(kv),
           "o": cols(q), "gate": rows(i), "up": rows(i), "gateb": rows(i), "upb": rows(i), "down": cols(i)}
    parts = {f"{prefix}embed_tokens.weight": rows(vocab), f"{head_prefix}lm_head.weight": rows(vocab)}
    for layer in range(config.num_layers):
        for key, name in _hf_names(config, layer, prefix).items():
            if key in per:
                parts[name] = per[key]
    return parts


def load_weights(model_dir, config: ModelConfig, *, device="cpu", dtype=torch.float32, tp=None) -> Weights:
    """Read the weights of a Hugging Face model directory with safetensors.

    Parameters
    ----------
    model_dir : str or Path
    config : ModelConfig
        From :func:`treeattn.engine.config.load_config`.
    device : str or torch.device
        Tensors are loaded directly onto it.
    dtype : torch.dtype
        Every tensor is cast to it.
    tp : TensorParallel, optional
        Read only this tensor-parallel rank's share (:mod:`treeattn.engine.parallel`).

    Raises
    ------
    FileNotFoundError
        No safetensors file, or a shard named by the index is missing.
    ValueError
        Only pickled checkpoints, a missing tensor or a tensor of the wrong shape; a model that
        does not split over ``tp`` (checked before anything is read).
    """
    from safetensors import safe_open

    if tp is not None:
        tp.check(config)
    path = Path(model_dir)
    where = _checkpoint_files(path)
    prefix, head_prefix = _prefixes(config, where)
    shapes = _expected_shapes(config, prefix, head_prefix)
    missing = [n for n in shapes if n not in where]
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} tensor(s) the {config.arch} config "
                         f"needs, e.g. {missing[:3]}")
    parts = _tp_parts(config, tp, prefix, head_prefix) if tp is not None else {}
    # the row-parallel biases are added once, by TP rank 0
    skip = {n for i in range(config.num_layers) for k, n in _hf_names(config, i, prefix).items()
            if k in ("ob", "downb")} if tp is not None and tp.rank else set()
    tensors, dev = {}, str(torch.device(device))
    for f in sorted(set(where[n] for n in shapes)):
        with safe_open(str(f), framework="pt", device=dev) as sf:
            for name in (n for n in shapes if where[n] == f and n not in skip):
                sl = sf.get_slice(name)
                if tuple(sl.get_shape()) != shapes[name]:
                    raise ValueError(f"{f.name}: tensor {name} has shape {tuple(sl.get_shape())} but the "
                                     f"config implies {shapes[name]}")
                if name in parts:
                    tensors[name] = sl[parts[name]].to(device=dev, dtype=dtype).contiguous()
                else:
                    tensors[name] = sf.get_tensor(name).to(dtype)
    extra = len(where) - len(shapes)
    if extra > 0:
        log.debug("%s: ignoring %d tensors the model does not use", path, extra)
    norm = _gemma_norm if config.gemma else (lambda w: w)
    layers = []
    for i in range(config.num_layers):
        n = {k: tensors.pop(v) for k, v in _hf_names(config, i, prefix).items() if v in tensors}
        layers.append(LayerWeights(
            qkv=torch.cat([n["q"], n["k"], n["v"]]).contiguous(),
            qkv_bias=torch.cat([n["qb"], n["kb"], n["vb"]]) if config.qkv_bias else None,
            o=n["o"], o_bias=n.get("ob"),
            gate_up=torch.cat([n["gate"], n["up"]]).contiguous(),
            gate_up_bias=torch.cat([n["gateb"], n["upb"]]) if config.mlp_bias else None,
            down=n["down"], down_bias=n.get("downb"),
            **{k: norm(n[k]) for k in _NORM_KEYS if k in n}))
    embed = tensors[f"{prefix}embed_tokens.weight"]
    head = embed if config.tie_word_embeddings else tensors[f"{head_prefix}lm_head.weight"]
    return Weights(embed=embed, layers=layers, norm=norm(tensors[f"{prefix}norm.weight"]), lm_head=head)


def _gemma_norm(w: torch.Tensor) -> torch.Tensor:
    """The float32 factor ``1 + w`` of a Gemma RMSNorm weight held in the model's dtype."""
    return 1.0 + w.float()


def random_weights(config: ModelConfig, *, device="cpu", dtype=torch.float32, seed: int = 0,
                   std: float = 0.02, tp=None) -> Weights:
    """Random weights of ``config``'s shape, drawn on ``device`` (no host copy; 8B in bf16 = 16 GB).

    Matrices are normal(0, ``std``), norms are the identity (ones; Gemma's float32 ``1 + 0``),
    biases zeros. With ``tp`` (a :class:`~treeattn.engine.parallel.TensorParallel`) the rank
    keeps its share of each matrix: every matrix is drawn whole, one at a time, and cut, so the
    shares are those of the same seed's unsplit weights.
    """
    if tp is not None:
        tp.check(config)
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def mat(*shape):
        return torch.empty(shape, device=device, dtype=dtype).normal_(0.0, std, generator=gen)

    def bias(n, on):
        return torch.zeros(n, device=device, dtype=dtype) if on else None

    def ones(n, on=True):
        return torch.ones(n, device=device, dtype=torch.float32 if config.gemma else dtype) if on else None

    def rows(t, sizes):
        """This rank's rows of each block of a column-parallel ``t`` (blocks of ``sizes`` rows)."""
        if tp is None or t is None:
            return t
        return torch.cat([b[tp.part(b.shape[0])] for b in t.split(sizes)])

    def cols(t):
        """This rank's columns of a row-parallel ``t``."""
        return t if tp is None else t[:, tp.part(t.shape[1])].contiguous()

    h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    d = config.head_dim
    first = tp is None or tp.rank == 0      # the row-parallel biases live on TP rank 0
    layers = [LayerWeights(
        qkv=rows(mat(q + 2 * kv, h), (q, kv, kv)), qkv_bias=rows(bias(q + 2 * kv, config.qkv_bias), (q, kv, kv)),
        o=cols(mat(h, q)), o_bias=bias(h, config.o_bias and first),
        gate_up=rows(mat(2 * i, h), (i, i)), gate_up_bias=rows(bias(2 * i, config.mlp_bias), (i, i)),
        down=cols(mat(h, i)), down_bias=bias(h, config.mlp_bias and first), attn_norm=ones(h),
        mlp_norm=ones(h), q_norm=ones(d, config.qk_norm), k_norm=ones(d, config.qk_norm),
        attn_out_norm=ones(h, config.gemma), mlp_out_norm=ones(h, config.gemma))
        for _ in range(config.num_layers)]
    embed = rows(mat(config.vocab_size, h), (config.vocab_size,))
    head = embed if config.tie_word_embeddings else rows(mat(config.vocab_size, h), (config.vocab_size,))
    return Weights(embed=embed, layers=layers, norm=ones(h), lm_head=head)


def load_tokenizer(model_dir):
    """The ``tokenizers.Tokenizer`` of ``model_dir/tokenizer.json``, or None when there is none."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ImportError(f"{path} needs the 'tokenizers' package (pip install tokenizers)") from e
    return Tokenizer.from_file(str(path))
