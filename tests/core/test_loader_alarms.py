"""``genworker.core.loader_alarms``: what a refit's direct routes wrote explains vLLM's
completeness alarms, one layer per written module, and nothing else is explained."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from genworker.core.loader_alarms import Alarm, Verdict, explain_alarms

CLASSES = {"layers.0.mlp": "Linear", "layers.1.mlp": "Linear", "layers.0.norm": "LayerNorm"}
WRITTEN = {"layers.0.mlp.weight", "layers.0.mlp.bias", "unknown.weight"}


def test_not_loaded_names_the_direct_routes_wrote_are_explained_and_the_rest_kept() -> None:
    alarms = [
        Alarm(True, set(WRITTEN)),
        Alarm(True, [*WRITTEN, "layers.1.mlp.weight"]),
        Alarm(True, "layers.0.mlp.weight"),  # not vLLM's shape
        Alarm(True, 3),
    ]
    assert explain_alarms(alarms, WRITTEN, CLASSES, []) == [
        Verdict(True),
        Verdict(False, frozenset({"layers.1.mlp.weight"})),
        Verdict(False),
        Verdict(False),
    ]


def test_each_written_module_and_each_module_without_parameters_explains_one_layer() -> None:
    alarms = [Alarm(False, name) for name in ("Linear", "Linear", "Rotary", "Rotary", "LayerNorm")]
    alarms.append(Alarm(False, 3))
    assert [v.explained for v in explain_alarms(alarms, WRITTEN, CLASSES, ["Rotary"])] == [
        True,
        False,  # layers.1.mlp: no route wrote it
        True,
        False,
        False,
        False,
    ]


@given(st.sets(st.sampled_from(sorted(CLASSES))), st.lists(st.sampled_from(["Linear", "X"])))
def test_no_more_layers_are_explained_than_modules_were_written(
    modules: set[str], names: list[str]
) -> None:
    written = {f"{m}.weight" for m in modules}
    verdicts = explain_alarms([Alarm(False, n) for n in names], written, CLASSES, [])
    explained = sum(v.explained for v in verdicts)
    assert explained == min(names.count("Linear"), sum(CLASSES[m] == "Linear" for m in modules))
