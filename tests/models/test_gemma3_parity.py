"""Parity of the Flax NNX Gemma 3 (text) with transformers' `gemma3` (the reference implementation).

Each case builds a tiny random `Gemma3ForCausalLM` WITH transformers, saves it with `save_pretrained`, loads
it with `models.gemma3.load`, and requires fp32 logits within 1e-4 on >= 300-token sequences (far longer than
the sliding windows of 8 and 16) and identical greedy continuations. Also: bf16 and sharded checkpoints, tied
and untied heads, the multimodal (`gemma3`) naming, config parsing against transformers' own, loader errors,
and the sliding-window semantics (a sliding layer sees `sliding_window` tokens including the current one).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import jax
import jax.numpy as jnp
from flax import nnx
from safetensors.numpy import save_file
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from models import gemma3
from models.gemma3 import FULL, SLIDING, CheckpointError, ConfigError, Gemma3Config, RopeSpec, tiny_config
from models.gemma3.checkpoint import read_safetensors

from .hf_reference import reproducible_torch

pytestmark = pytest.mark.parity

S, F = SLIDING, FULL
CASES = {
    # 5:1 sliding:full, GQA 4 heads / 2 kv heads, window 16, tied head
    "p6_gqa_w16": tiny_config(),
    # 2:1 sliding:full, MQA (1 kv head), window 8, untied head
    "p3_mqa_w8_untied": tiny_config(
        layer_types=(S, S, F, S, S, F), num_key_value_heads=1, sliding_window=8, tie_word_embeddings=False
    ),
    # full layer first, final logit softcap 2 (tanh well away from linear), linear rope x8 on full layers,
    # other thetas; attn_logit_softcapping is set but transformers (and we) never apply it
    "softcap_linear_rope_w8": tiny_config(
        num_hidden_layers=4,
        layer_types=(F, S, S, F),
        sliding_window=8,
        final_logit_softcapping=2.0,
        attn_logit_softcapping=50.0,
        rope_full=RopeSpec(500_000.0, "linear", 8.0),
        rope_sliding=RopeSpec(5_000.0),
        query_pre_attn_scalar=24,
    ),
}
TOL = 1e-4


def build_hf(cfg: Gemma3Config, seed: int = 0, dtype=torch.float32) -> Gemma3ForCausalLM:
    """A transformers Gemma 3 for `cfg` with every parameter random (norm weights too: Gemma scales by 1 + w)."""
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**cfg.to_hf())).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if name.endswith("norm.weight") else 0.08
            p.copy_(scale * torch.randn(p.shape, generator=g))
    return model.to(dtype)


def hf_logits(hf, ids: np.ndarray) -> np.ndarray:
    with reproducible_torch(), torch.no_grad():
        return hf(torch.tensor(ids)).logits.float().numpy()


def max_err(got, want) -> float:
    return float(np.abs(np.asarray(got) - np.asarray(want)).max())


_BUILT: dict[str, dict] = {}


def built(name: str, tmp_path_factory) -> dict:
    """Case `name` built once per module: the transformers model, its save folder, our load and jitted forward."""
    if name not in _BUILT:
        cfg = CASES[name]
        hf = build_hf(cfg, seed=len(name))
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(str(path))
        ours = gemma3.load(path, dtype="float32")
        _BUILT[name] = {"name": name, "cfg": cfg, "hf": hf, "ours": ours, "fwd": gemma3.forward_fn(ours), "path": path}
    return _BUILT[name]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    yield built(request.param, tmp_path_factory)


@pytest.fixture(scope="module", autouse=True)
def _drop_built():
    yield
    _BUILT.clear()


def test_config_round_trip(case):
    assert case["ours"].cfg == case["cfg"]
    has_head = "lm_head.weight" in read_safetensors(os.path.join(case["path"], "model.safetensors"))
    assert has_head == (not case["cfg"].tie_word_embeddings)
    # the head is held [hidden, vocab]; tied, it is the only copy of the embedding table
    assert (case["ours"].embed_tokens is None) == case["cfg"].tie_word_embeddings
    assert case["ours"].lm_head.value.shape == (case["cfg"].hidden_size, case["cfg"].vocab_size)


def test_logits_match_transformers(case):
    ours = case["ours"]
    ids = np.random.default_rng(7).integers(0, ours.cfg.vocab_size, (2, 307))
    got = np.asarray(case["fwd"](ids))
    want = hf_logits(case["hf"], ids)
    assert got.shape == want.shape == (2, 307, ours.cfg.vocab_size)
    err = np.abs(got - want).max(axis=(0, 2))
    assert err.max() < TOL, f"max |logit diff| {err.max():.3g}, first bad position {int(np.argmax(err >= TOL))}"


def test_greedy_continuation_matches_transformers_generate(case):
    ours = case["ours"]
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, ours.cfg.vocab_size, n).tolist() for n in (300, 257)]
    new = 12
    tokens, logits = gemma3.greedy_stateless(ours, prompts, new, fwd=case["fwd"])
    for prompt, toks, lg in zip(prompts, tokens, logits, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            # explicit all-ones mask: otherwise generate() treats every id equal to pad_token_id as padding
            out = case["hf"].generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        assert out.sequences[0, len(prompt) :].tolist() == toks
        assert max_err(lg, torch.stack(out.logits, dim=1)[0].float().numpy()) < TOL


def test_sharded_checkpoint_loads_identically(tmp_path, tmp_path_factory):
    case = built("p6_gqa_w16", tmp_path_factory)
    case["hf"].save_pretrained(str(tmp_path), max_shard_size="100KB")
    shards = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert len(shards) > 2 and os.path.exists(tmp_path / "model.safetensors.index.json")
    ours = gemma3.load(tmp_path)
    ids = np.random.default_rng(3).integers(0, ours.cfg.vocab_size, (1, 64))
    assert max_err(gemma3.forward_fn(ours)(ids), case["fwd"](ids)) == 0.0
    # streamed onto a mesh: every weight on each of its devices, the same values, the same logits
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(4, 1), ("data", "model"))
    placed = gemma3.load(tmp_path, mesh=mesh)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(placed)), nnx.to_flat_state(nnx.state(ours)), strict=True):
        a, b = a.get_value(), b.get_value()
        assert a.sharding.mesh == mesh and a.sharding.is_fully_replicated, path
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert max_err(gemma3.forward_fn(placed)(ids), case["fwd"](ids)) == 0.0


def test_multimodal_names_and_config_load_identically(tmp_path, tmp_path_factory):
    """A Gemma3ForConditionalGeneration-style folder: `gemma3` config with text_config, language-model tensors
    under `model.language_model.` (transformers 5) or `language_model.model.` (older Hub saves), vision skipped."""
    case = built("p3_mqa_w8_untied", tmp_path_factory)
    src = read_safetensors(os.path.join(case["path"], "model.safetensors"))
    text_cfg = json.loads((case["path"] / "config.json").read_text())
    ids = np.random.default_rng(5).integers(0, case["cfg"].vocab_size, (1, 40))
    for inner, head in (
        ("model.language_model.", "lm_head.weight"),
        ("language_model.model.", "language_model.lm_head.weight"),
    ):
        d = tmp_path / inner.strip(".").replace(".", "_")
        d.mkdir()
        out = {
            head if k == "lm_head.weight" else inner + k[len("model.") :]: np.ascontiguousarray(v)
            for k, v in src.items()
        }
        out["model.vision_tower.vision_model.post_layernorm.weight"] = np.ones(3, np.float32)
        out["model.multi_modal_projector.mm_input_projection_weight"] = np.ones((3, 2), np.float32)
        save_file(out, str(d / "model.safetensors"))
        cfg = {"model_type": "gemma3", "text_config": text_cfg, "vision_config": {"model_type": "siglip_vision_model"}}
        (d / "config.json").write_text(json.dumps(cfg))
        ours = gemma3.load(d)
        assert ours.cfg == case["cfg"]
        assert max_err(gemma3.forward_fn(ours)(ids), case["fwd"](ids)) == 0.0


def test_sliding_window_sees_window_tokens_including_current():
    """HF `sliding_window=W`: query i sees keys i-W+1 .. i (W tokens incl. itself). With one sliding layer,
    the logits at t change with token t-W+1 and not with token t-W — in transformers and here alike."""
    w, t = 8, 40
    cfg = tiny_config(num_hidden_layers=1, layer_types=(S,), sliding_window=w)
    hf = build_hf(cfg, seed=1)
    ours = gemma3.Gemma3(cfg, {k.removeprefix("model."): v.detach().numpy() for k, v in hf.state_dict().items()})
    assert cfg.window == w
    fwd = gemma3.forward_fn(ours)
    base = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, t))
    q = t - 1
    for changed, visible in ((q - w, False), (q - w + 1, True)):
        ids = base.copy()
        ids[0, changed] = (ids[0, changed] + 1) % cfg.vocab_size
        for run in (lambda x: np.asarray(fwd(x)), lambda x: hf_logits(hf, x)):
            diff = max_err(run(ids)[0, q], run(base)[0, q])
            assert (diff > 1e-3) == visible, (changed, diff)
    np.testing.assert_allclose(np.asarray(fwd(base)), hf_logits(hf, base), atol=TOL, rtol=0)


def test_bf16_checkpoint(tmp_path):
    cfg = tiny_config(layer_types=(S, S, F, S, S, F), sliding_window=8)
    hf = build_hf(cfg, seed=2, dtype=torch.bfloat16)
    hf.save_pretrained(str(tmp_path))
    header = read_safetensors(tmp_path / "model.safetensors")
    assert {str(v.dtype) for v in header.values()} == {"bfloat16"}
    ids = np.random.default_rng(9).integers(0, cfg.vocab_size, (1, 300))
    # bf16 weights upcast: exact against transformers loading the same checkpoint in float32. (Not `hf.float()`:
    # `.to(bfloat16)` also rounded the in-memory RoPE inv_freq buffers, which from_pretrained keeps float32.)
    ours32 = gemma3.load(tmp_path, dtype="float32")
    want32 = hf_logits(Gemma3ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval(), ids)
    assert max_err(gemma3.forward_fn(ours32)(ids), want32) < TOL
    # bf16 compute: weights kept bit-exact, logits near transformers' own bf16 run
    ours16 = gemma3.load(tmp_path, dtype=jnp.bfloat16)
    assert ours16.lm_head.value.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        # held [in, out], q/k/v joined: q's columns first
        np.asarray(ours16.layers[0].attn.qkv_proj.value.astype(jnp.float32))[
            :, : cfg.num_attention_heads * cfg.head_dim
        ].T,
        hf.model.layers[0].self_attn.q_proj.weight.detach().float().numpy(),
    )
    got16 = np.asarray(gemma3.forward_fn(ours16)(ids))
    want16 = hf_logits(Gemma3ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16).eval(), ids)
    scale = np.abs(want32).max()
    e16, e32 = max_err(got16, want16), max_err(got16, want32)
    assert e16 < 0.05 * scale and e32 < 0.05 * scale, (e16, e32, scale)
    assert (got16.argmax(-1) == want32.argmax(-1)).mean() > 0.9


# ------------------------------------------------------------------- config


def test_legacy_config_keys_parse_like_transformers():
    legacy = {
        "model_type": "gemma3_text",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 16,
        "sliding_window_pattern": 4,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "query_pre_attn_scalar": 16,
    }
    ours = Gemma3Config.from_hf(legacy)
    hf = Gemma3TextConfig(**{k: v for k, v in legacy.items() if k != "model_type"})
    assert list(ours.layer_types) == hf.layer_types
    assert ours.layer_types == (S, S, S, F, S, S, S, F)
    assert ours.rope_parameters[FULL] == {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0}
    for t in (S, F):
        for key in ("rope_type", "rope_theta", "factor"):
            assert ours.rope_parameters[t].get(key) == hf.rope_parameters[t].get(key), (t, key)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"model_type": "llama"}, ["model_type", "llama"]),
        ({"num_key_value_heads": 3}, ["num_key_value_heads=3"]),
        ({"layer_types": [S, "local"] * 3}, ["layer_types", "local"]),
        ({"layer_types": [S, F]}, ["len(layer_types)=2", "num_hidden_layers=6"]),
        ({"rope_parameters": {FULL: {"rope_type": "yarn", "factor": 2.0}}}, ["rope_type='yarn'", FULL]),
        ({"hidden_activation": "silu"}, ["hidden_activation='silu'"]),
        ({"sliding_window": None}, ["sliding_window=None"]),
        ({"final_logit_softcapping": -1.0}, ["final_logit_softcapping=-1.0"]),
        ({"use_bidirectional_attention": True}, ["use_bidirectional_attention"]),
    ],
)
def test_bad_config_values_are_named(change, words):
    d = {**tiny_config().to_hf(), **change}
    with pytest.raises(ConfigError) as e:
        Gemma3Config.from_hf(d)
    for word in words:
        assert word in str(e.value)


# ------------------------------------------------------------------ loader errors


@pytest.fixture(scope="module")
def saved_tensors():
    cfg = tiny_config(num_hidden_layers=2)
    return cfg, {"model." + k: v for k, v in gemma3.random_tensors(cfg, 0).items()}


def _write(path, cfg, tensors):
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf(), f)


def test_loader_names_wrong_shape_missing_and_unknown_tensors(saved_tensors, tmp_path):
    cfg, tensors = saved_tensors
    _write(tmp_path / "ok", cfg, tensors)
    ours = gemma3.load(tmp_path / "ok")
    np.testing.assert_array_equal(
        np.asarray(ours.layers[1].mlp.gate_up_proj.value)[:, cfg.intermediate_size :].T,  # [in, gate | up]
        tensors["model.layers.1.mlp.up_proj.weight"],
    )

    bad = dict(tensors)
    bad["model.layers.1.self_attn.k_proj.weight"] = np.zeros((48, 64), np.float32)
    _write(tmp_path / "shape", cfg, bad)
    with pytest.raises(
        CheckpointError, match=r"'layers\.1\.self_attn\.k_proj\.weight' has shape \(48, 64\), expected \(32, 64\)"
    ):
        gemma3.load(tmp_path / "shape")

    bad = {k: v for k, v in tensors.items() if k != "model.layers.0.self_attn.q_norm.weight"}
    bad["model.layers.0.self_attn.q_bias"] = np.zeros(4, np.float32)
    _write(tmp_path / "names", cfg, bad)
    with pytest.raises(CheckpointError) as e:
        gemma3.load(tmp_path / "names")
    assert "missing tensors ['layers.0.self_attn.q_norm.weight']" in str(e.value)
    assert "unknown tensors ['layers.0.self_attn.q_bias']" in str(e.value)

    shutil.copytree(tmp_path / "ok", tmp_path / "nocfg")
    os.remove(tmp_path / "nocfg" / "config.json")
    with pytest.raises(ConfigError, match=r"no config\.json"):
        gemma3.load(tmp_path / "nocfg")


def test_random_init_runs_and_is_causal():
    model = gemma3.init(tiny_config(), seed=0)
    fwd = gemma3.forward_fn(model)
    ids = np.random.default_rng(1).integers(0, 512, (1, 24))
    full = np.asarray(fwd(ids))
    assert full.shape == (1, 24, 512) and np.isfinite(full).all()
    assert max_err(np.asarray(fwd(ids[:, :10])), full[:, :10]) < 1e-5
    with pytest.raises(ValueError, match="vocab_size=512"):
        fwd(np.array([[0, 512]]))


def test_pieces_compose_into_a_kv_cached_decode():
    """The public pieces (embed, rope_tables, project_qkv, attention_mask, dense_attention, project_output,
    ffn_block, logits) rebuild the forward around a fixed-size per-layer K/V buffer: prefill, then one-token
    steps attending to the written history (sliding layers masked to the last `window` positions)."""
    cfg = tiny_config(num_hidden_layers=3, layer_types=(S, F, S), sliding_window=4)
    model = gemma3.init(cfg, seed=3)
    n = 16
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (1, n))
    want = np.asarray(gemma3.forward_fn(model)(ids))
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, tokens, start, kv):
        m = nnx.merge(graphdef, state)
        pos = start + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        k_pos = jnp.arange(n, dtype=jnp.int32)[None]
        rope = m.rope_tables(pos)
        x = m.embed(tokens)
        new_kv = []
        for layer, (kc, vc) in zip(m.layers, kv, strict=True):
            q, k, v = layer.attn.project_qkv(layer.input_norm(x), *rope[layer.layer_type])
            kc = jax.lax.dynamic_update_slice_in_dim(kc, k, start, axis=1)
            vc = jax.lax.dynamic_update_slice_in_dim(vc, v, start, axis=1)
            mask = gemma3.attention_mask(pos, k_pos, layer.window)  # unwritten slots lie in the future
            o = gemma3.dense_attention(q, kc, vc, mask, cfg.scaling)
            x = layer.ffn_block(x + layer.post_attention_norm(layer.attn.project_output(o)))
            new_kv.append((kc, vc))
        return m.logits(x), new_kv

    empty = jnp.zeros((1, n, cfg.num_key_value_heads, cfg.head_dim), jnp.float32)
    kv = [(empty, empty)] * cfg.num_hidden_layers
    logits, kv = step(state, jnp.asarray(ids[:, :10], jnp.int32), 0, kv)
    got = [np.asarray(logits)]
    for t in range(10, n):
        logits, kv = step(state, jnp.asarray(ids[:, t : t + 1], jnp.int32), t, kv)
        got.append(np.asarray(logits))
    assert max_err(np.concatenate(got, axis=1), want) < 1e-5
