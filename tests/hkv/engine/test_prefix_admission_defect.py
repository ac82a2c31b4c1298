"""The prefix cache's admission control (`PrefixManager.after_step`: "a sequence that restored nothing
may displace only never-reused chains") starves new conversations for good once the record slots are
held by chains that were reused once and then went idle: a new prompt restores nothing, so it may not
displace them; it records one block and stops (`record_stopped`); its follow-ups then restore nothing
either (its one block has no SWA + TAIL snapshot), so they may not displace anything, and so on --
the cache never admits the new conversation, however often it comes back, while the idle chain is
never touched again. Found by benchmarks/serving.py: in a small engine (`hkv serve --slots 1
--max-context 128`), the benchmark's two warm-up requests (the second restoring the first) held 7 of
the 8 record slots and every later multi-turn conversation restored 0 tokens. A server whose
conversations share no system prompt (each first turn restores nothing) meets it once its record
slots fill with conversations reused once (each turn 2 reuses its turn 1). Marked xfail (strict)
until the admission lets repeated demand in (the fix removes the marker)."""

from __future__ import annotations

import hkv
from models import toy

BT = 16  # the engine's default block_tokens


def test_a_reused_idle_chain_does_not_starve_a_returning_conversation():
    model = toy.init(toy.ToyConfig(), seed=3)
    engine = hkv.Engine(model, hkv.CacheConfig(slots=1, max_context=128, page_size=16, prefix_records=8))
    idle = [(7 * i) % 60 + 3 for i in range(7 * BT)]  # 7 of the 8 record slots
    engine.generate([idle], 2)
    assert engine.generate([[*idle, 1]], 2)[0].plan.restored_tokens == 7 * BT  # reused once, then never again
    new = [5] * 8 + [(11 * i) % 50 + 1 for i in range(40)]  # 3 blocks, sharing nothing with `idle`
    reply = engine.generate([new], 4)[0].tokens
    follow_up = [*new, *reply, 9, 9, 9]
    restored = [engine.generate([follow_up], 4)[0].plan.restored_tokens for _ in range(4)]
    assert restored[-1] >= 3 * BT, f"the returning conversation's prefix was never cached: restored {restored}"
