"""FP8 checkpoints read exactly as their producers write them: tiny NemotronH checkpoints (dense
and MoE layers) quantized in each format, saved with the producer's tensor names, scale shapes
and config, generate HF's greedy tokens where HF runs on the dequantized weights (fp32); on a GPU
through the FP8 kernels and CUDA graphs. Load-time quantization against the same oracle."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_models import HF_LATENT_MOE, save_tiny
from test_model import new_runner, step

from mambastep import Engine, SamplingParams
from mambastep.graphs import BucketSet
from mambastep.kernels.fp8 import Fp8Weight
from mambastep.runtime.model import Model
from mambastep.runtime.weights import WeightError

FP8_MAX = 448.0
# the tiny layout (hf_models.nemotron_h_config): mamba, attention, mlp, mamba, moe, attention, mamba
ATTENTION, BEFORE_ATTENTION = (1, 5), (0, 3)
# the producer's names of the linears a quantizer converts
LINEAR = re.compile(r"backbone\.layers\.(\d+)\.mixer\.(in_proj|out_proj|[qkvo]_proj|up_proj|down_proj"
                    r"|shared_experts\.(up|down)_proj|experts\.\d+\.(up|down)_proj)\.weight")
# NVIDIA's recipe: attention, the Mamba layer before it, conv1d, the router and the LM head in bf16
MODELOPT_EXCLUDE = ["lm_head", *(f"backbone.layers.{i}.mixer*" for i in ATTENTION + BEFORE_ATTENTION),
                    "*conv1d*", "*mixer.gate*"]


def _quantize(w: torch.Tensor, scheme: str, block: int):
    """(FP8 values, the scale as the producer stores it, the dequantized weight): the test's own
    quantizer, independent of mambastep's."""
    w = w.float()
    if scheme == "tensor":
        scale = w.abs().amax() / FP8_MAX
        full = scale
    elif scheme == "channel":
        scale = w.abs().amax(dim=1) / FP8_MAX
        full = scale[:, None]
    else:
        n, k = w.shape
        nb, kb = -(-n // block), -(-k // block)
        scale = torch.zeros(nb, kb)
        for i in range(nb):
            for j in range(kb):
                scale[i, j] = w[i * block:(i + 1) * block, j * block:(j + 1) * block].abs().amax() / FP8_MAX
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    values = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values, scale, values.float() * full


# name -> (quantization_config (None: ModelOpt's hf_quant_config.json), scheme, block, scale
# tensor suffix, the stored scale's shape from the block scales', static input scales)
FORMATS = {
    "modelopt-fp8": (None, "tensor", 0, "weight_scale", None, True),
    "modelopt-fp8-in-config": ({"quant_method": "modelopt", "quant_algo": "FP8", "ignore": MODELOPT_EXCLUDE,
                                "kv_cache_scheme": {"type": "float", "num_bits": 8}},
                               "tensor", 0, "weight_scale", None, True),
    "modelopt-fp8-per-channel": ({"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN",
                                  "exclude_modules": MODELOPT_EXCLUDE}, "channel", 0, "weight_scale", None, False),
    "modelopt-fp8-pb-wo": ({"quant_method": "modelopt", "quant_algo": "FP8_PB_WO",
                            "exclude_modules": MODELOPT_EXCLUDE}, "block", 128, "weight_scale",
                           lambda s: s[:, None, :, None], False),
    "fp8-block": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [16, 16]}, "block", 16, "weight_scale_inv", None, False),
}


# the formats that ask for an FP8 KV cache, and the key and value scales their producer stores
# beside each attention layer's k_proj and v_proj
FP8_KV_FORMATS = ("modelopt-fp8", "modelopt-fp8-in-config")
KV_SCALES = {"k_proj": ("k_scale", 0.05), "v_proj": ("v_scale", 0.04)}


def write_fp8(src, dst, deq, fmt: str) -> None:
    """The bf16/fp32 checkpoint at ``src`` quantized as ``fmt``'s producer writes it, to ``dst``;
    and its dequantized weights, as a plain checkpoint for HF, to ``deq``."""
    quant, scheme, block, scale_name, stored_shape, static = FORMATS[fmt]
    tensors = load_file(src / "model.safetensors")
    out, plain = {}, dict(tensors)
    excluded = set(ATTENTION + BEFORE_ATTENTION) if fmt.startswith("modelopt") else set()
    for name, t in tensors.items():
        m = LINEAR.fullmatch(name)
        if m is None:
            out[name] = t
            continue
        if int(m.group(1)) in excluded:  # kept in bf16, as the producer stores them: HF sees the rounding too
            out[name] = t.to(torch.bfloat16)
            plain[name] = out[name].float()
            continue
        values, scale, dequantized = _quantize(t, scheme, block)
        base = name.removesuffix(".weight")
        out[name] = values
        out[f"{base}.{scale_name}"] = stored_shape(scale) if stored_shape else scale
        if static:
            out[f"{base}.input_scale"] = torch.tensor(0.02)
        plain[name] = dequantized
    if fmt in FP8_KV_FORMATS:
        for i in ATTENTION:
            for proj, (what, value) in KV_SCALES.items():
                out[f"backbone.layers.{i}.mixer.{proj}.{what}"] = torch.tensor(value)
    for path in (dst, deq):
        shutil.copytree(src, path, dirs_exist_ok=True)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    save_file(plain, deq / "model.safetensors", metadata={"format": "pt"})
    if quant is None:
        (dst / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt", "version": "0.37.0"},
            "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": MODELOPT_EXCLUDE}}))
    else:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))


PROMPT_LENS = (1, 9, 40)
NEW_TOKENS = 8
BUCKETS = BucketSet(decode=(1, 2, 4), mixed_decode=(0, 2, 4), prefill=(16, 64), max_prefill_seqs=4)
_gpu = pytest.mark.gpu


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_greedy(hf, prompts):
    return [hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
            for p in prompts]


def _engine_greedy(path, device, **kw):
    engine = Engine.from_pretrained(path, dtype=torch.float32, device=device, buckets=BUCKETS, num_slots=4,
                                    max_context=128, progress=False, **kw)
    assert (engine.capture_report is not None) == (device == "cuda")
    return engine.generate(_prompts(), SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))


def _hf(path, fp8_kv: bool = False):
    """HF's model of the checkpoint at ``path``; ``fp8_kv``: its attention layers' keys and values
    rounded as an FP8 KV cache over KV_SCALES holds them (k / scale to e4m3, saturated, times the
    scale), in every use, the token's own too."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for name, module in hf.named_modules() if fp8_kv else ():
        m = re.search(r"layers\.\d+\.mixer\.([kv]_proj)$", name)
        if m:
            scale = KV_SCALES[m.group(1)][1]
            module.register_forward_hook(
                lambda _, __, y, s=scale: (y / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s)
    return hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16")
    save_tiny("nemotron_h", path)
    return path


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_gpu)])
@pytest.mark.parametrize("fmt", list(FORMATS))
@torch.no_grad()
def test_fp8_checkpoint_generates_hfs_tokens_on_the_dequantized_weights(tiny, tmp_path, fmt, device):
    write_fp8(tiny, tmp_path / "fp8", tmp_path / "deq", fmt)
    got = _engine_greedy(tmp_path / "fp8", device)
    assert got == _hf_greedy(_hf(tmp_path / "deq", fp8_kv=fmt in FP8_KV_FORMATS), _prompts())


@torch.no_grad()
def test_fp8_logits_match_hf_and_excluded_modules_stay_full_precision(tiny, tmp_path):
    write_fp8(tiny, tmp_path / "fp8", tmp_path / "deq", "modelopt-fp8")
    model = Model.from_pretrained(tmp_path / "fp8", dtype=torch.float32)
    kinds = {i: type(getattr(b.mixer, {"mamba": "in_proj", "attention": "qkv", "mlp": "up", "moe": "up"}[k]))
             for i, (b, k) in enumerate(zip(model.blocks, model.cfg.layer_types))}
    assert kinds == {0: torch.Tensor, 1: torch.Tensor, 2: Fp8Weight, 3: torch.Tensor, 4: Fp8Weight,
                     5: torch.Tensor, 6: Fp8Weight}
    assert isinstance(model.blocks[4].mixer.shared[0], Fp8Weight)
    assert model.cfg.quantization.kv_cache == "fp8"
    # the FP8 KV cache: its scales on the attention layers, the pool's keys and values in e4m3
    scales = [b.mixer.kv_scale for b in model.blocks if hasattr(b.mixer, "kv_scale")]
    assert len(scales) == 2 and all(torch.equal(s, torch.tensor([0.05, 0.04])) for s in scales)
    runner = new_runner(model)
    assert {t.dtype for t in (*runner.pool.k.values(), *runner.pool.v.values())} == {torch.float8_e4m3fn}
    # static input scales kept, merged across a stack's experts
    assert model.blocks[4].mixer.up.input_scale.item() == pytest.approx(0.02)
    ids = _prompts()[2]
    ref = _hf(tmp_path / "deq", fp8_kv=True)(torch.tensor([ids])).logits[0, -1]
    logits = step(runner, [(ids, 0, 0)])[0]
    # the same roundings on both sides (keys and values unrounded would be 1.2e-4 off)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_w8a8_asked_of_an_fp32_model_leaves_its_experts_as_they_are(tiny, tmp_path, monkeypatch):
    """``MoEMixer.w8a8`` on: an fp32 model's FP8 experts, which W8A8 does not take (``takes_w8a8``:
    bf16 or fp16 activations), run as without it over a prompt's many pairs, not an error mid-step."""
    from mambastep.runtime.mixers.moe import MoEMixer

    model = Model.from_pretrained(tiny, dtype=torch.float32, quantization="fp8")
    ids = _prompts()[2]
    assert len(ids) * model.cfg.num_experts_per_tok > 12  # past the pairs: the sorted layout W8A8 would take
    monkeypatch.setattr(MoEMixer, "w8a8", False)
    plain = step(new_runner(model), [(ids, 0, 0)])[0]
    monkeypatch.setattr(MoEMixer, "w8a8", True)
    assert torch.equal(step(new_runner(model), [(ids, 0, 0)])[0], plain)


@torch.no_grad()
def test_a_bf16_models_fp8_experts_quantize_their_rows_past_the_pairs_by_default(tiny, monkeypatch):
    """W8A8 is the model's default for FP8 experts under bf16 activations: a prompt's many pairs
    reach the experts with ``w8a8`` asked, and its logits move from W8A16's by the rows' e4m3
    rounding, no more."""
    from mambastep.runtime.mixers import moe as moe_mixer

    asked = []

    def spy(*args, **kw):
        asked.append(kw["w8a8"])
        return experts(*args, **kw)

    experts = moe_mixer.moe_experts
    monkeypatch.setattr(moe_mixer, "moe_experts", spy)
    model = Model.from_pretrained(tiny, dtype=torch.bfloat16, quantization="fp8")
    ids = _prompts()[2]
    w8a8 = step(new_runner(model), [(ids, 0, 0)])[0].float()
    assert asked and all(asked)
    asked.clear()
    monkeypatch.setattr(moe_mixer.MoEMixer, "w8a8", False)
    w8a16 = step(new_runner(model), [(ids, 0, 0)])[0].float()
    assert asked and not any(asked)
    assert not torch.equal(w8a8, w8a16)
    assert (w8a8 - w8a16).norm() / w8a16.norm() < 0.1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_gpu)])
@torch.no_grad()
def test_block_norms_hand_their_fp8_mixers_the_rows_quantized_as_the_products_would(tiny, device, monkeypatch):
    """Layer by layer past a few rows, a block norm whose mixer's FP8 products quantize its output
    per row writes it quantized too (``Mixer.takes_rows``, ``model.NORM_ROWS``): each such mixer
    is handed rows equal to ``quantize_rows`` of its input, the others none, and the logits are
    those of the products quantizing the rows themselves, to the bit. On the CPU, where no product
    quantizes, the rule is told the products would (the wiring is what is checked)."""
    from mambastep.kernels import fp8 as fp8_kernels, linear as linear_kernels, moe as moe_kernels
    from mambastep.kernels.fp8 import quantize_rows
    from mambastep.runtime import model as model_mod
    from mambastep.runtime.mixers import mamba2, mlp, moe

    if device == "cpu":
        def would(M, dtype, dev, weight):
            return isinstance(weight, Fp8Weight) and M > 8
        for mod in (mamba2, mlp, moe):
            monkeypatch.setattr(mod, "takes_rows", would)
    model = Model.from_pretrained(tiny, dtype=torch.bfloat16, device=device, quantization="fp8")
    ids = _prompts()[2]
    handed = {}
    for i, block in enumerate(model.blocks):
        def spy(h, ctx, rows=None, _forward=block.mixer.forward, _i=i):
            handed[_i] = (h.clone(), rows and [t.clone() for t in rows])
            return _forward(h, ctx, rows)
        monkeypatch.setattr(block.mixer, "forward", spy)
    calls = []
    for mod in (fp8_kernels, moe_kernels, linear_kernels):  # linear: W8A8 few-row products quantize there
        monkeypatch.setattr(mod, "quantize_rows", lambda *a, _q=mod.quantize_rows, **k: calls.append(1) or _q(*a, **k))
    with_rows = step(new_runner(model), [(ids, 0, 0)])[0]
    quantized_here = len(calls)
    took = sorted(i for i, (_, rows) in handed.items() if rows is not None)
    # the FP8 mixers whose products quantize: on the GPU not the Mamba2 layer's in_proj, whose N
    # (200) is no multiple of 16 (its weight is dequantized for the product instead)
    assert took == ([2, 4, 6] if device == "cpu" else [2, 4])
    assert took == [i for i, b in enumerate(model.blocks) if b.mixer.takes_rows(len(ids), model.dtype, model.device)]
    for h, rows in handed.values():
        if rows is not None:  # what the quantizer makes of h on the same device
            q, scale = quantize_rows(h)
            assert torch.equal(rows[1], scale) and torch.equal(rows[0].float(), q.float())
    monkeypatch.setattr(model_mod, "NORM_ROWS", False)
    calls.clear()
    assert torch.equal(step(new_runner(model), [(ids, 0, 0)])[0], with_rows)
    if device == "cuda":  # the MLP's up and the MoE's routed experts quantize h themselves (its
        # shared expert's up, N = 24, is dequantized as the in_proj is)
        assert len(calls) == quantized_here + 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_gpu)])
@torch.no_grad()
def test_the_gated_norm_and_relu2_hand_their_fp8_products_the_rows_quantized_as_the_products_would(
        tiny, device, monkeypatch):
    """Past a few rows, where out_proj's and a down projection's FP8 products would quantize their
    input per row, the gated norm and relu2 write it quantized too (``mamba2.GATED_ROWS``,
    ``mlp.ACT_ROWS``): each such product is handed rows equal to ``quantize_rows`` of its input,
    and the logits are those of the products quantizing the rows themselves, to the bit (CPU: the
    rule told the products would)."""
    from mambastep.kernels.fp8 import quantize_rows
    from mambastep.runtime.mixers import mamba2, mlp

    if device == "cpu":
        def would(M, dtype, dev, weight):
            return isinstance(weight, Fp8Weight) and M > 8
        for mod in (mamba2, mlp):
            monkeypatch.setattr(mod, "takes_rows", would)
    model = Model.from_pretrained(tiny, dtype=torch.bfloat16, device=device, quantization="fp8")
    ids = _prompts()[2]
    # out_proj, the MLP's down and the shared expert's: FP8 where the load quantized them
    weights = [b.mixer.out_proj for b in model.blocks if isinstance(b.mixer, mamba2.Mamba2Mixer)]
    weights += [b.mixer.down for b in model.blocks if isinstance(b.mixer, mlp.MLPMixer)]
    weights += [b.mixer.shared[1] for b in model.blocks if getattr(b.mixer, "shared", None) is not None]
    weights = {id(w): w for w in weights if isinstance(w, Fp8Weight)}
    expected = {i for i, w in weights.items() if mamba2.takes_rows(len(ids), model.dtype, model.device, w)}
    assert weights and (expected or device == "cuda")
    seen = []
    for mod in (mamba2, mlp):
        monkeypatch.setattr(mod, "linear", lambda x, w, b=None, rows=None, _linear=mod.linear: (
            id(w) in weights and seen.append((id(w), x.clone(), rows and [t.clone() for t in rows])),
            _linear(x, w, b, rows))[1])
    with_rows = step(new_runner(model), [(ids, 0, 0)])[0]
    assert {i for i, _, rows in seen if rows is not None} == expected
    for _, x, rows in seen:
        if rows is not None:  # what the quantizer makes of the product's input on the same device
            q, scale = quantize_rows(x)
            assert torch.equal(rows[1], scale) and torch.equal(rows[0].float(), q.float())
    monkeypatch.setattr(mamba2, "GATED_ROWS", False)
    monkeypatch.setattr(mlp, "ACT_ROWS", False)
    assert torch.equal(step(new_runner(model), [(ids, 0, 0)])[0], with_rows)


@pytest.mark.skipif(not HF_LATENT_MOE, reason="the installed transformers has no latent MoE")
@torch.no_grad()
def test_a_latent_moe_hands_the_rows_to_its_projection_into_the_latent_space(tmp_path, monkeypatch):
    """With a latent space (Nemotron 3 Super's), h's readers that quantize are the projection into
    it and the shared expert's up: both take the norm's rows (CPU: the rule told they would)."""
    from mambastep.runtime.mixers import moe

    monkeypatch.setattr(moe, "takes_rows", lambda M, dtype, dev, weight: isinstance(weight, Fp8Weight) and M > 8)
    save_tiny("nemotron_h", tmp_path, layers_block_type=["mamba", "moe", "attention", "moe"], n_routed_experts=16,
              num_experts_per_tok=3, moe_latent_size=16)
    model = Model.from_pretrained(tmp_path, dtype=torch.bfloat16, quantization="fp8")
    latent = [b.mixer for b in model.blocks if isinstance(b.mixer, moe.MoEMixer)]
    assert latent and all(m.latent is not None and isinstance(m.latent[0], Fp8Weight) for m in latent)
    seen = []
    monkeypatch.setattr(moe, "linear", lambda x, w, b=None, rows=None, _linear=moe.linear: (
        seen.append((w, rows)), _linear(x, w, b, rows))[1])
    monkeypatch.setattr(moe, "mlp", lambda *a, rows=None, _mlp=moe.mlp, **k: (seen.append(("shared", rows)),
                                                                             _mlp(*a, rows=rows, **k))[1])
    step(new_runner(model), [(_prompts()[2], 0, 0)])
    for m in latent:
        into = [rows for w, rows in seen if w is m.latent[0]]
        assert len(into) == 1 and into[0] is not None
    assert [rows is not None for w, rows in seen if isinstance(w, str)] == [True] * len(latent)


@pytest.mark.parametrize("kind", ["nemotron_h", "falcon_h1"])
@torch.no_grad()
def test_attention_and_parallel_blocks_hand_the_rows_to_their_fp8_projections(kind, tmp_path, monkeypatch):
    """An attention layer whose qkv is FP8 (a checkpoint that quantizes it; NVIDIA's recipe keeps it
    in bf16) takes the norm's rows into qkv; a parallel block (Falcon-H1) whose first projections
    are FP8, so that it runs its mixers apart, into both (CPU: the rule told the products would
    quantize)."""
    from mambastep.kernels.fp8 import quantize_fp8
    from mambastep.runtime.config import ModelConfig
    from mambastep.runtime.mixers import attention, mamba2
    from mambastep.runtime.mixers.parallel import ParallelMixer
    from mambastep.runtime.weights import load_weights

    def would(M, dtype, dev, weight):
        return isinstance(weight, Fp8Weight) and M > 8
    seen = []
    for mod in (attention, mamba2):
        monkeypatch.setattr(mod, "takes_rows", would)
        monkeypatch.setattr(mod, "linear", lambda x, w, b=None, rows=None, _linear=mod.linear: (
            seen.append((w, rows)), _linear(x, w, b, rows))[1])
    save_tiny(kind, tmp_path)
    cfg = ModelConfig.from_pretrained(tmp_path)
    weights = load_weights(tmp_path, cfg, dtype=torch.bfloat16)
    if kind == "falcon_h1":
        for name in [n for n in weights if re.search(r"mixer\.(in|q|k|v)_proj\.weight$", n)]:
            weights[name] = quantize_fp8(weights[name])
    model = Model(cfg, weights)
    firsts = []  # each attention layer's qkv, each parallel block's qkv and in_proj, quantized
    for block in model.blocks:
        m = block.mixer
        if isinstance(m, ParallelMixer):
            assert not m.joint
            firsts += [m.mamba.in_proj, m.attention.qkv]
        elif isinstance(m, attention.AttentionMixer):
            m.qkv = quantize_fp8(m.qkv)
            firsts.append(m.qkv)
    assert len(firsts) >= 2
    step(new_runner(model), [(_prompts()[2], 0, 0)])
    for w in firsts:
        handed = [rows for v, rows in seen if v is w]
        assert len(handed) == 1 and handed[0] is not None


def _quantize_hf_in_place(hf, excluded_layers):
    """HF's linears as mambastep's load-time quantization leaves them: per output channel, the
    attention layers and the Mamba layer before each kept (the test's own quantizer)."""
    for name, p in hf.named_parameters():
        name = name.replace("model.", "backbone.", 1)
        stack = re.fullmatch(r"backbone\.layers\.(\d+)\.mixer\.experts\.(up|down)_proj", name)  # HF stacks experts
        m = stack or LINEAR.fullmatch(name)
        if m and int(m.group(1)) not in excluded_layers:
            for w in p.data if stack else [p.data]:
                w.copy_(_quantize(w, "channel", 0)[2])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_gpu)])
@torch.no_grad()
def test_load_time_quantization_generates_hfs_tokens_on_the_same_quantization(tiny, device):
    got = _engine_greedy(tiny, device, quantization="fp8")
    hf = _hf(tiny)
    _quantize_hf_in_place(hf, set(ATTENTION + BEFORE_ATTENTION))
    assert got == _hf_greedy(hf, _prompts())


def test_an_fp8_tensor_the_config_excludes_is_refused(tiny, tmp_path):
    write_fp8(tiny, tmp_path / "fp8", tmp_path / "deq", "fp8-block")
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["backbone.layers.2.mixer.up_proj"]
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightError, match=r"layers\.2\.mixer\.up_proj\.weight: .* exclude_modules keeps it"):
        Model.from_pretrained(tmp_path / "fp8", dtype=torch.float32)


def _refused(tiny, tmp_path, fmt: str, edit, match: str) -> None:
    """A ``fmt`` checkpoint whose tensors ``edit`` changed is refused with a WeightError matching ``match``."""
    write_fp8(tiny, tmp_path / "fp8", tmp_path / "deq", fmt)
    path = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(WeightError, match=match):
        Model.from_pretrained(tmp_path / "fp8", dtype=torch.float32)


SCALE = "backbone.layers.4.mixer.experts.2.down_proj.weight_scale"


def test_a_missing_or_misshaped_scale_is_named(tiny, tmp_path):
    _refused(tiny, tmp_path, "modelopt-fp8", lambda t: t.pop(SCALE), r"experts\.2\.down_proj\.weight_scale: missing")
    _refused(tiny, tmp_path, "modelopt-fp8", lambda t: t.update({SCALE: torch.ones(32)}),
             r"experts\.2\.down_proj\.weight_scale: expected shape \[\] .*has \[32\]")


def test_an_fp8_lm_head_is_refused_by_name(tiny, tmp_path):
    def to_fp8(tensors):
        tensors["lm_head.weight"] = tensors["lm_head.weight"].to(torch.float8_e4m3fn)

    _refused(tiny, tmp_path, "fp8-block", to_fp8, r"lm_head\.weight: stored as F8_E4M3; mambastep reads only the block")


def test_an_unknown_quantization_name_is_refused(tiny):
    with pytest.raises(ValueError, match="quantization: expected one of"):
        Model.from_pretrained(tiny, dtype=torch.float32, quantization="int4")


def test_load_time_quantization_lets_each_full_precision_weight_go(tiny):
    """``quantize_online`` replaces the weights in their dict, so each full-precision tensor is
    freed as its FP8 copy arrives: a bf16 model that fills a card still quantizes on it."""
    import weakref

    from mambastep.runtime.config import ModelConfig
    from mambastep.runtime.quantization import online_fp8
    from mambastep.runtime.weights import quantize_online, random_weights

    cfg = ModelConfig.from_pretrained(tiny)
    weights = random_weights(cfg, dtype=torch.bfloat16)
    quant = online_fp8(cfg.layer_types)
    kept = {n: weakref.ref(w) for n, w in weights.items()}
    out = quantize_online(weights, quant)
    assert out is weights
    quantized = [n for n, w in out.items() if isinstance(w, Fp8Weight)]
    assert quantized and all(kept[n]() is None for n in quantized)  # the bf16 originals are gone
    assert all(kept[n]() is out[n] for n in out if n not in quantized)  # the rest untouched


KV = "backbone.layers.1.mixer.k_proj.k_scale"


def test_an_fp8_kv_caches_scales_are_read_beside_the_projection_or_the_module_and_checked(tiny, tmp_path):
    def move(t):  # where vLLM's remapping puts it: on the attention module
        t["backbone.layers.1.mixer.k_scale"] = t.pop(KV)

    write_fp8(tiny, tmp_path / "fp8", tmp_path / "deq", "modelopt-fp8")
    path = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(path)
    move(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    assert torch.equal(Model.from_pretrained(tmp_path / "fp8", dtype=torch.float32).blocks[1].mixer.kv_scale,
                       torch.tensor([0.05, 0.04]))
    _refused(tiny, tmp_path, "modelopt-fp8", lambda t: t.pop(KV),
             r"k_proj\.k_scale: missing; ModelOpt FP8 asks for an FP8 KV cache")
    _refused(tiny, tmp_path, "modelopt-fp8", lambda t: t.update({KV: torch.tensor(0.0)}),
             r"k_proj\.k_scale: an FP8 KV cache scale must be positive and finite, got 0.0")
    _refused(tiny, tmp_path, "modelopt-fp8", lambda t: t.update({KV: torch.ones(2)}),
             r"k_proj\.k_scale: expected one float scale, checkpoint has F32 of shape \[2\]")


def test_an_fp8_kv_cache_halves_the_keys_and_values_bytes_a_slot_takes(tiny, tmp_path):
    """The engine sizes its slots from ``bytes_per_slot``: an FP8 cache's keys and values take one
    byte an element, the recurrent states what they took."""
    from dataclasses import replace

    from mambastep.runtime.state_pool import StatePool

    write_fp8(tiny, tmp_path / "fp8", tmp_path / "deq", "modelopt-fp8")
    cfg = Model.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16).cfg
    plain = replace(cfg, quantization=replace(cfg.quantization, kv_cache=None))
    kv = 2 * 64 * cfg.num_key_value_heads * cfg.attention_head_dim * len(cfg.layers_of("attention"))
    assert StatePool.bytes_per_slot(plain, 64, torch.bfloat16) - StatePool.bytes_per_slot(cfg, 64, torch.bfloat16) == kv
    pool = StatePool(cfg, 2, 64, dtype=torch.bfloat16)
    assert sum(t.nbytes for t in pool.tensors()) == 2 * StatePool.bytes_per_slot(cfg, 64, torch.bfloat16)
