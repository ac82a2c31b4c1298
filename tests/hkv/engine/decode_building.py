"""`DecodeStillBuilding`: force an engine to decode through its prefill step (tests of
`hkv.Engine.decode_while_building`)."""

from __future__ import annotations


class DecodeStillBuilding:
    """An engine's decode step that reads as still building and whose `build_ahead` starts nothing:
    with `decode_while_building` on, every decoded token then goes through the prefill step.
    `asked` holds, for each `build_ahead` call, the prefill variants the engine had run by then."""

    def __init__(self, engine):
        self.real, self.engine, self.asked = engine.steps.decode, engine, []
        engine.steps.decode = self

    def __call__(self, *args):
        raise AssertionError("the decode step ran while it was building")

    def building(self, layout, *args) -> bool:
        return True

    def build_ahead(self, layout, cache, *args, **kw) -> bool:
        self.asked.append(set(self.engine.compile_plan.prefill_variants))
        return False
