"""`check_model`: the conformance kit a model author runs in their own tests.

    from hkv.testing import check_model
    def test_my_model_conforms():
        report = check_model(my_model)          # raises AssertionError naming the failed check

It uses only the `hkv.CachedModel` protocol (the stateless `model(tokens)` is the oracle) and checks:
  (a) the protocol is implemented;
  (b) cold prefill in every chunk size and prefill batch, then greedy decode, equals the stateless
      forward bit for bit (the numerical contract, docs/numerics.md), in the model's own dtype;
  (c) a prefix restored at every tested cut point, by every route the spec allows (kept snapshots,
      window rebuild, disk tier), gives the cold run's tokens and logits, and the route was taken;
      a spec with a full-attention layer never takes the window-rebuild route;
  (d) `hkv.check_invariants` holds after every `generate`;
  (e) one compilation per bucket (prefill, decode) however many requests ran.
"""

from __future__ import annotations

import dataclasses
import tempfile

import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import numerics as nm
from .core.invariants import check_invariants
from .core.layout import CacheConfig, CacheLayout
from .core.plan import ROUTES
from .core.policy import RetentionPolicy, window_rebuild_tokens
from .core.protocol import check_protocol
from .engine.engine import Engine
from .engine.options import accepts_snapshots
from .store.tier import DiskTier


@dataclasses.dataclass
class ConformanceReport:
    """What `check_model` verified.

    checks: names of the checks that ran and passed, in order (e.g. "stateless[chunk=16]",
      "restore[snapshot]@32").
    routes: restore route -> the cut points (prompt prefix lengths) restored by it ("snapshot",
      "window", "disk"); "window_refused": cut points where a full-attention spec correctly fell back.
    max_abs_diff: the largest |logit difference| against the stateless forward over all checks.
    window_rebuild_tokens: R of the spec (0: the window-rebuild route is not allowed).
    engine_config, engine_options: the `CacheConfig` and `Engine` keyword arguments of the prefix
      engine the restore checks ran on: `Engine(model, report.engine_config, **report.engine_options)`
      serves the checked model with the programs compiled during the check (no new compilation).
    """

    checks: list[str] = dataclasses.field(default_factory=list)
    routes: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    max_abs_diff: float = 0.0
    window_rebuild_tokens: int = 0
    engine_config: CacheConfig | None = None
    engine_options: dict = dataclasses.field(default_factory=dict)


def _fail(check: str, detail: str) -> AssertionError:
    return AssertionError(f"check_model: {check}: {detail}")


def _first_difference(got: np.ndarray, want: np.ndarray, prompt_len: int) -> str:
    """'' when got == want bitwise, else where they first differ: the position (prompt_len + i for the
    i-th new token's logits), the vocabulary index and both values."""
    if got.shape != want.shape:
        return f"logits shape {got.shape} != {want.shape}"
    diff = np.argwhere(~((got == want) | (np.isnan(got) & np.isnan(want))))
    if not len(diff):
        return ""
    i, v = (int(x) for x in diff[0])
    return (
        f"first difference at position {prompt_len - 1 + i} (new token {i}), logit {v}: "
        f"cached {got[i, v]!r} vs stateless {want[i, v]!r}"
    )


def _reference(model, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy continuation of every prompt by re-running the stateless forward (one compilation)."""
    graphdef, state = nnx.split(model)
    fwd = nm.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    lengths = np.array([len(p) for p in prompts])
    buf = np.zeros((len(prompts), int(lengths.max()) + new_tokens), np.int32)
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = p
    toks, logits = [[] for _ in prompts], [[] for _ in prompts]
    rows, cur = np.arange(len(prompts)), lengths.copy()
    for _ in range(new_tokens):
        lg = np.asarray(fwd(state, jnp.asarray(buf)), np.float32)[rows, cur - 1]
        ids = lg.argmax(-1)
        for i in rows:
            toks[i].append(int(ids[i]))
            logits[i].append(lg[i])
        buf[rows, cur] = ids
        cur += 1
    return toks, [np.stack(x) for x in logits]


class _Checker:
    def __init__(self, model, ref, tolerance: float, report: ConformanceReport):
        self.model, self.ref, self.tol, self.report = model, ref, tolerance, report

    def compare(self, check: str, gens, prompts) -> None:
        for g, p in zip(gens, prompts, strict=True):
            want_t, want_l = self.ref[tuple(p)]
            got_l = np.asarray(g.logits)
            d = float(np.abs(got_l - want_l).max()) if got_l.shape == want_l.shape and got_l.size else 0.0
            self.report.max_abs_diff = max(self.report.max_abs_diff, d)
            where = _first_difference(got_l, want_l, len(p))
            if g.tokens != want_t:
                raise _fail(
                    check,
                    f"prompt of {len(p)} tokens: cached tokens {g.tokens} != stateless {want_t} "
                    f"(max |Δ logits| = {d:.3g}; {where})",
                )
            if self.tol == 0.0 and where:
                raise _fail(
                    check,
                    f"prompt of {len(p)} tokens: logits not bitwise equal to the stateless forward's: {where} "
                    f"(max |Δ| = {d:.3g}; see docs/numerics.md)",
                )
            if not d <= self.tol:
                raise _fail(check, f"prompt of {len(p)} tokens: max |Δ logits| = {d:.3g} > tolerance {self.tol:g}")

    def generate(self, check: str, engine: Engine, prompts, new_tokens: int):
        try:
            gens = engine.generate(prompts, new_tokens, return_logits=True)
        except ValueError as e:  # a model the cache refuses (e.g. a CacheSpec dtype unlike its activations)
            raise _fail(check, f"{type(e).__name__}: {e}") from e
        try:
            check_invariants(engine.layout, engine.cache)
        except Exception as e:  # InvariantError
            raise _fail(f"invariants after {check}", str(e)) from e
        self.compare(check, gens, prompts)
        return gens


def _engine(model, block_tokens, chunk, max_context, prefix: bool, disk=None, kernel_options=None) -> Engine:
    spec = model.cache_spec(block_tokens=block_tokens)
    base = CacheConfig(slots=2, max_context=max_context, page_size=block_tokens, prefix_records=0)
    scale = 4 if prefix else 1  # room for prefix records' snapshots next to two live sequences
    layout = CacheLayout(spec, base)
    pages = tuple(layout.reserved_pages(g) * scale for g in range(len(layout.groups)))
    config = dataclasses.replace(base, pool_pages=pages, prefix_records=64 if prefix else 0)
    return Engine(model, config, block_tokens=block_tokens, prefill_chunk=chunk,
                  retention=RetentionPolicy(every_n_blocks=1), kernel_options=kernel_options, disk=disk)  # fmt: skip


def force_route(engine: Engine, route: str | None) -> None:
    """Make `engine` restore by `route` whenever that route is offered, so a test reaches a route the
    cost model would not pick (None: back to the engine's own costs).

    Args:
        engine: the engine whose `prefix_manager` chooses routes.
        route: a restore route of `hkv.core.plan.ROUTES` ("shrink", "window", "disk"), or None.
    Raises:
        ValueError: another route name.
    """
    if route is not None and route not in ROUTES:
        raise ValueError(f"route={route!r} must be None or one of {ROUTES}")
    manager = engine.prefix_manager
    if route is None:
        manager.__dict__.pop("estimate", None)
        return
    own = type(manager).estimate

    def estimate(*a, **kw):
        costs = own(manager, *a, **kw)
        if route not in costs.offered():
            return costs
        return dataclasses.replace(costs, **{k: (0.0 if k == route else float("inf")) for k in costs.offered()})

    manager.estimate = estimate


def _forget(engine: Engine, *, snapshots_only: bool) -> None:
    """Evict every cached record's SWA + TAIL snapshot (or every whole record) from device memory."""
    nr = engine.layout.config.prefix_records
    every, none = jnp.ones((nr,), bool), jnp.zeros((nr,), bool)
    engine.cache = engine.steps.evict(engine.layout, engine.cache, every, every, none if snapshots_only else every)


def _compile_counts(check: str, engine: Engine) -> None:
    counts = engine.compilations
    if not counts or any(n != 1 for n in counts.values()):
        raise _fail(check, f"engine.compilations = {counts}; want exactly one compilation per bucket")


@dataclasses.dataclass
class _Prompts:
    """The prompts `check_model` runs and the engine geometry they need.

    block_tokens: tokens per cache block; window: R of the spec (0: no window-rebuild route).
    base: the base prompt; cuts: the tested cut points (prompt prefix lengths) into it.
    by_route: (route, cut) -> base[:cut] then tokens that differ from base and from every other
      route's prompt (so no request's own blocks serve a later one).
    max_context: tokens per slot of every engine; new_tokens: greedy tokens generated per request.
    """

    block_tokens: int
    window: int
    base: list[int]
    cuts: list[int]
    by_route: dict[tuple[str, int], list[int]]
    max_context: int
    new_tokens: int


def _prompts(
    model, block_tokens: int, prompt_tokens: int | None, new_tokens: int, max_context: int | None, seed: int
) -> _Prompts:
    """The base prompt, the cut points and the diverging prompt of every (route, cut): `_Prompts`."""
    bt = block_tokens
    r = window_rebuild_tokens(model.cache_spec(block_tokens=bt))
    past_r = (r // bt + 1) * bt if r else 0  # the first boundary a window rebuild can restore
    n = prompt_tokens or max(3 * bt, past_r) + 5
    tail = 3
    rng = np.random.default_rng(seed)
    base = rng.integers(0, model.vocab_size, n).tolist()
    cuts = sorted({c for c in (bt, 2 * bt, 3 * bt, bt + bt // 2, 2 * bt + 3, past_r) if 0 < c <= n - 1})

    def diverge(cut: int, route: int) -> list[int]:
        """base[:cut], then tokens that differ from base at `cut` and from every other route's prompt
        (so no request's own blocks serve a later one)."""
        rest = np.random.default_rng(seed + 1000 + cut).integers(0, model.vocab_size, tail).tolist()
        rest[0] = (base[cut] + 1 + route) % model.vocab_size if cut < n else (rest[0] + route) % model.vocab_size
        return base[:cut] + rest

    routes = ("snapshot", "disk", "window")
    prompts = {(route, c): diverge(c, i) for i, route in enumerate(routes) for c in cuts}
    longest = max(n, *(len(p) for p in prompts.values())) + new_tokens
    ctx = max_context or -(-(longest + bt) // bt) * bt
    return _Prompts(bt, r, base, cuts, prompts, ctx, new_tokens)


def _checker(model, pr: _Prompts, tolerance: float, report: ConformanceReport) -> _Checker:
    """A `_Checker` against the stateless forward's greedy continuation of every prompt in `pr`."""
    every = [pr.base, *pr.by_route.values()]
    ref_toks, ref_logits = _reference(model, every, pr.new_tokens)
    ref = {tuple(p): (t, lg) for p, t, lg in zip(every, ref_toks, ref_logits, strict=True)}
    return _Checker(model, ref, tolerance, report)


def _check_cold(ck: _Checker, pr: _Prompts, chunk_sizes: tuple[int, ...], restore_chunk: int, kernels: dict) -> None:
    """(b) cold prefill in each chunk size + greedy decode == stateless forward; (e) one compile per bucket."""
    for chunk in chunk_sizes:
        if chunk == restore_chunk:
            continue  # the restore engine below runs this chunk size cold first
        name = f"stateless[chunk={chunk}]"
        eng = _engine(ck.model, pr.block_tokens, chunk, pr.max_context, prefix=False, kernel_options=kernels)
        ck.generate(name, eng, [pr.base], pr.new_tokens)
        ck.generate(name + " batch", eng, [pr.by_route["snapshot", c] for c in pr.cuts[:2]], pr.new_tokens)
        _compile_counts(f"compilations[chunk={chunk}]", eng)
        ck.report.checks.append(name)


def _restore_engine(ck: _Checker, pr: _Prompts, chunk: int, kernels: dict) -> Engine:
    """The prefix engine of the restore checks, recorded in the report, after its cold run of the base
    prompt. chunk: its prefill chunk; every boundary keeps a snapshot (block_tokens: each ends a step;
    a wider one, for a model taking `snapshots`: the boundaries inside a step keep theirs too)."""
    bt = pr.block_tokens
    eng = _engine(ck.model, bt, chunk, pr.max_context, prefix=True, kernel_options=kernels)
    ck.report.engine_config = eng.layout.config
    ck.report.engine_options = {"block_tokens": bt, "prefill_chunk": chunk, "kernel_options": kernels}
    ck.generate(f"stateless[chunk={chunk}]", eng, [pr.base], pr.new_tokens)
    ck.report.checks.append(f"stateless[chunk={chunk}]")
    return eng


def _restore(ck: _Checker, eng: Engine, pr: _Prompts, route: str, cut: int, want_window: bool, want_disk: bool) -> None:
    """(c) the prompt of (route, cut) restores its last boundary by `route` and gives the cold tokens."""
    check = f"restore[{route}]@{cut}"
    (g,) = ck.generate(check, eng, [pr.by_route[route, cut]], pr.new_tokens)
    p, boundary, r = g.plan, cut // pr.block_tokens * pr.block_tokens, pr.window
    if p.window_recomputed is not None and r == 0:
        raise _fail(check, f"the window-rebuild route was taken for a spec with full-attention layers: {p}")
    got = (p.restored_tokens, p.window_recomputed, p.disk_tokens)
    want = (
        boundary,
        (boundary - r, boundary) if want_window else None,
        (0, boundary) if want_disk else None,
    )
    if got != want:
        raise _fail(check, f"(restored_tokens, window_recomputed, disk_tokens) = {got}, want {want}; plan {p}")
    ck.report.routes.setdefault(route, []).append(cut)
    ck.report.checks.append(check)


def _check_disk(ck: _Checker, eng: Engine, pr: _Prompts, disk_dir: str | None) -> None:
    """(c) from disk: write every block through, forget the device copies, restore at every cut."""
    own_dir = None if disk_dir is not None else tempfile.TemporaryDirectory(prefix="hkv-check-model-")
    tier = DiskTier(disk_dir if disk_dir is not None else own_dir.name)
    try:
        eng.disk = tier
        force_route(eng, "disk")
        eng.write_through()
        eng.flush_disk()
        for cut in pr.cuts:
            _forget(eng, snapshots_only=False)
            _restore(ck, eng, pr, "disk", cut, False, True)
        eng.flush_disk()
    finally:
        eng.disk = None
        force_route(eng, None)
        tier.close()
        if own_dir is not None:
            own_dir.cleanup()


def _check_window(ck: _Checker, eng: Engine, pr: _Prompts) -> None:
    """(c) with the snapshots forgotten, every cut rebuilds the window where the spec allows it; a spec
    with a full-attention layer refuses the route and restores nothing."""
    ck.generate("re-warm", eng, [pr.base], pr.new_tokens)  # every record of the base chain on device again
    force_route(eng, "window")  # rebuild the window whenever the engine may
    try:
        for cut in pr.cuts:
            _forget(eng, snapshots_only=True)
            check = f"restore[window]@{cut}"
            if pr.window == 0:  # full-attention layers: the route must be refused, restoring nothing exactly
                (g,) = ck.generate(check, eng, [pr.by_route["window", cut]], pr.new_tokens)
                if g.plan.window_recomputed is not None or g.plan.restored_tokens != 0:
                    raise _fail(check, f"a spec with full-attention layers restored without a snapshot: {g.plan}")
                ck.report.routes.setdefault("window_refused", []).append(cut)
                ck.report.checks.append(check)
            elif cut // pr.block_tokens * pr.block_tokens > pr.window:
                _restore(ck, eng, pr, "window", cut, True, False)
            else:  # the boundary is inside the receptive field: nothing to rebuild from
                ck.generate(check, eng, [pr.by_route["window", cut]], pr.new_tokens)
    finally:
        force_route(eng, None)


def check_model(
    model,
    *,
    block_tokens: int = 16,
    chunk_sizes: tuple[int, ...] = (16, 32),
    max_context: int | None = None,
    prompt_tokens: int | None = None,
    new_tokens: int = 3,
    seed: int = 0,
    disk_dir: str | None = None,
    kernel_backend: str | None = None,
    interpret: bool = False,
    tolerance: float = 0.0,
) -> ConformanceReport:
    """Check that `model`'s cached path (`hkv.CachedModel`) is exact and restores exactly.

    Args:
      model: the model under test (an NNX module implementing `hkv.CachedModel`).
      block_tokens: tokens per cache block (the restore granularity).
      chunk_sizes: prefill chunk sizes whose cold runs are compared with the stateless forward; the
        restore checks use the widest of them when the model's cached_step takes `snapshots` (the
        boundaries inside a chunk are restored from the snapshots the step prepared), else chunk =
        block_tokens (each boundary ends a step).
      max_context: tokens per slot (default: the longest prompt plus new tokens, rounded up to blocks).
      prompt_tokens: length of the base prompt (default 3 blocks + 5 tokens, longer when the spec's
        window rebuild needs more); cut points are the block boundaries 1..3 (those that fit), two
        mid-block points and the first boundary past the receptive field (window rebuild).
      new_tokens: greedy tokens generated per request (>= 1).
      seed: seed of the random prompts.
      disk_dir: directory for the disk tier of the disk route (default: a temporary directory).
      kernel_backend, interpret: the `pallas_kernels` implementation of the decode ops.
      tolerance: max |logit difference| allowed against the stateless forward; 0.0 (default) asks for
        bitwise equality, hkv's numerical contract (a failure names the check, the position and the
        first differing logit).

    Returns:
      a `ConformanceReport` (checks passed, routes taken, max |Δ|).

    Raises:
      AssertionError: naming the failed check, the chunk size or cut point, and the max |Δ|.
    """
    report = ConformanceReport()
    try:
        check_protocol(model)
    except TypeError as e:
        raise _fail("protocol", str(e)) from e
    report.checks.append("protocol")
    pr = _prompts(model, block_tokens, prompt_tokens, new_tokens, max_context, seed)
    report.window_rebuild_tokens = pr.window
    ck = _checker(model, pr, tolerance, report)
    kernels = {"kernel_backend": kernel_backend, "interpret": interpret}
    # a model taking `snapshots` restores inside its widest chunk; others where each step ends
    restore_chunk = max(chunk_sizes) if accepts_snapshots(model) else block_tokens
    _check_cold(ck, pr, chunk_sizes, restore_chunk, kernels)
    eng = _restore_engine(ck, pr, restore_chunk, kernels)
    for cut in pr.cuts:  # kept snapshots
        _restore(ck, eng, pr, "snapshot", cut, False, False)
    _check_disk(ck, eng, pr, disk_dir)
    _check_window(ck, eng, pr)
    _compile_counts("compilations[restore engine]", eng)
    report.checks.append("compilations")
    return report


__all__ = ["ConformanceReport", "check_model", "force_route"]
