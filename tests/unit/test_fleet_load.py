"""Loading ``nodes.yaml`` and ``workloads.yaml`` for ``tensora plan``: every problem is named by file, line and
field, as the file's model and the checks name it; and the one pass of pydantic over the workloads accepts what
the file's model accepts and gives what it gives (hypothesis)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from tensora.config import yamlsource
from tensora.config.catalog import default_catalog
from tensora.control import fleet
from tensora.control.spec import WorkloadSpec
from tensora.errors import FleetError

CATALOG = default_catalog()
NB = "kind: notebook, gpu_class: l40s-48gb"

WORKLOAD_ERRORS = {
    "not a mapping": ("- a\n", "w.yaml:1: expected a mapping with a 'workloads' list"),
    "empty": ("", "w.yaml:1: expected a mapping with a 'workloads' list"),
    "a key beside workloads": ("workloads: []\nnodes: []\n", "w.yaml:2: nodes: unknown field"),
    "no workloads key": ("other: 1\n", "w.yaml:1: workloads: field required"),
    "workloads not a list": ("workloads: abc\n", "w.yaml:1: workloads: must be a list"),
    "a workload not a mapping": ("workloads:\n  - abc\n",
                                 "w.yaml:2: workloads[0]: must be a mapping of names to values"),
    "an unknown field": (f"workloads:\n  - {{{NB}, name: a, colour: red}}\n",
                         "w.yaml:2: workloads[0].colour: unknown field"),
    "a bad offset before an unknown field (fields first)": (
        f"workloads:\n  - {{{NB}, name: a, colour: red, submitted_at: xx}}\n",
        "w.yaml:2: workloads[0].submitted_at: expected a duration"),
    "a bad name before a bad offset (the file's order)": (
        f"workloads:\n  - {{{NB}, name: A_B, submitted_at: xx}}\n",
        "w.yaml:2: workloads[0].name: lowercase letters, digits and '-', 1-63 characters"),
    "a bad offset of the first before a bad name of the second": (
        f"workloads:\n  - {{{NB}, name: a, submitted_at: x}}\n  - {{{NB}, name: B!}}\n",
        "w.yaml:2: workloads[0].submitted_at: expected a duration"),
    "a negative offset": (f"workloads:\n  - {{{NB}, name: a, submitted_at: -5}}\n",
                          "w.yaml:2: workloads[0].submitted_at: a duration must be finite and >= 0"),
    "a bad stop": (f"workloads:\n  - {{{NB}, name: a, stop_at: soon}}\n",
                   "w.yaml:2: workloads[0].stop_at: expected a duration"),
    "a stop before the submission": (f"workloads:\n  - {{{NB}, name: a, submitted_at: 5m, stop_at: 1m}}\n",
                                     "w.yaml:2: workloads[0].stop_at: stop_at is before submitted_at"),
    "a body's error after a duplicate name (bodies first)": (
        f"workloads:\n  - {{{NB}, name: a}}\n  - {{{NB}, name: a}}\n  - {{kind: vm, name: b, gpu_class: NO_}}\n",
        "w.yaml:4: workloads[2].gpu_class: lowercase letters, digits and '-'"),
    "a wait too long, on the line it is written (not the workload's)": (
        "workloads:\n  - kind: notebook\n    name: nb\n    gpu_class: l40s-48gb\n    fallback: [cpu]\n"
        "    fallback_after: 31d\n", "w.yaml:6: workloads[0].fallback_after: at most 30 days"),
    "a duplicate name": (f"workloads:\n  - {{{NB}, name: a}}\n  - {{{NB}, name: a}}\n",
                         "w.yaml:3: workloads[1].name: duplicate workload name 'a'"),
    "an unknown class": ("workloads:\n  - {kind: notebook, name: a, gpu_class: h900}\n",
                         "w.yaml:2: workloads[0].gpu_class: unknown class 'h900'; see the catalog"),
    "an unknown fallback": (f"workloads:\n  - {{{NB}, name: a, fallback: [cpu, tpu]}}\n",
                            "w.yaml:2: workloads[0].fallback[1]: unknown class 'tpu'"),
    "fallback_after twice": (f"workloads:\n  - {{{NB}, name: a, fallback_after: 1m, fallback_after_s: 60}}\n",
                             "w.yaml:2: workloads[0]: give fallback_after or fallback_after_s"),
    "an endpoint's field on a notebook": (f"workloads:\n  - {{{NB}, name: a, model_params: 7B}}\n",
                                          "w.yaml:2: workloads[0].model_params: model_params is for"),
    "a spec key a notebook does not take": (f"workloads:\n  - {{{NB}, name: a, spec: {{serverless: true}}}}\n",
                                            "w.yaml:2: workloads[0].spec.serverless: unknown field for a notebook"),
    "a name that is a number": (f"workloads:\n  - {{{NB}, name: 123}}\n",
                                "w.yaml:2: workloads[0].name: must be a string"),
    "a key twice": (f"workloads:\n  - {{{NB}, name: a, name: b}}\n",
                    "w.yaml:2: workloads[0].name: key 'name' appears twice"),
    "an alias: the same workload twice": (f"workloads:\n  - &w {{{NB}, name: a}}\n  - *w\n",
                                          "w.yaml:2: workloads[1].name: duplicate workload name 'a'"),
    "a model file that is not there": (
        "workloads:\n  - {kind: endpoint, name: a, gpu_class: l40s-48gb, model: nowhere.safetensors}\n",
        "w.yaml:2: workloads[0].model: "),
    "not YAML": ("workloads:\n  - {kind: notebook\n", "w.yaml:3: not valid YAML"),
}


@pytest.mark.parametrize(("text", "message"), WORKLOAD_ERRORS.values(), ids=WORKLOAD_ERRORS.keys())
def test_a_bad_workloads_file_names_file_line_and_field(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "w.yaml").write_text(text)
    with pytest.raises(FleetError) as got:
        fleet.load_workloads(tmp_path / "w.yaml", CATALOG)
    assert str(got.value).startswith(f"{tmp_path / message}")


NODE = "{name: x, allocatable: {cpu: 4, memory: 8Gi}}"
NODE_ERRORS = {
    "a duplicate name": (f"nodes:\n  - {NODE}\n  - {NODE}\n", "n.yaml:3: nodes[1].name: duplicate node name 'x'"),
    "an unknown field": ("nodes:\n  - name: x\n    allocatable: {cpu: 4, memory: 8Gi, gpu: {L40S: 1}}\n",
                         "n.yaml:3: nodes[0].allocatable.gpu: unknown field"),
    "a negative cpu": ("nodes:\n  - {name: x, allocatable: {cpu: -4, memory: 8Gi}}\n",
                       "n.yaml:2: nodes[0].allocatable.cpu: at least 0"),
    "a bad memory": ("nodes:\n  - {name: x, allocatable: {cpu: 4, memory: lots}}\n",
                     "n.yaml:2: nodes[0].allocatable.memory: expected a size"),
    "not a mapping": ("- x\n", "n.yaml:1: expected a mapping with a 'nodes' list"),
}


@pytest.mark.parametrize(("text", "message"), NODE_ERRORS.values(), ids=NODE_ERRORS.keys())
def test_a_bad_nodes_file_names_file_line_and_field(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "n.yaml").write_text(text)
    with pytest.raises(FleetError) as got:
        fleet.load_nodes(tmp_path / "n.yaml")
    assert str(got.value).startswith(f"{tmp_path / message}")


def test_the_collector_is_left_as_it_was(tmp_path: Path) -> None:
    import gc

    (tmp_path / "w.yaml").write_text("workloads: abc\n")
    assert gc.isenabled()
    with pytest.raises(FleetError):
        fleet.load_workloads(tmp_path / "w.yaml", CATALOG)
    assert gc.isenabled()


# Each field of a workload: values the file's model accepts (drawn more often), then values it refuses.
FIELDS: dict[str, tuple[list[Any], list[Any]]] = {
    "kind": (["notebook", "vm", "endpoint"], ["toaster"]),
    "name": (["a", "b-1"], ["A_B", 123]),
    "gpu_class": (["l40s-48gb", "cpu-16c-64g"], ["NO_"]),
    "owner": (["alice"], [""]),
    "fallback": ([[], ["cpu"]], [["cpu", "cpu"], ["l40s-48gb"]]),
    "fallback_after": ([0, "5m"], ["xx", -1]),
    "fallback_after_s": ([30], []),
    "model_params": (["7B", 10**9], ["many"]),
    "image": (["disk.qcow2"], []),
    "replicas": ([1, 2], [17]),
    "spec": ([{}, {"ttft_deadline_s": 5}], [{"serverless": "yes"}, {"x": 10**30}]),
    "submitted_at": ([0, "90s", 1.5], ["soon", -5, True]),
    "stop_at": ([None, "2m"], ["never"]),
    "colour": ([], ["red"]),
}


def _values(good: list[Any], bad: list[Any]) -> st.SearchStrategy[Any]:
    return st.sampled_from(good * 4 + bad)


REQUIRED = ("kind", "name", "gpu_class")
workload_items = st.fixed_dictionaries(
    {k: _values(*FIELDS[k]) for k in REQUIRED},
    optional={k: _values(*v) for k, v in FIELDS.items() if k not in REQUIRED})


@given(st.lists(workload_items, max_size=4))
def test_one_pass_accepts_what_the_files_model_accepts_and_gives_what_it_gives(items: list[dict[str, Any]]) -> None:
    data = {"workloads": items}
    lines = yamlsource.Lines({})
    try:
        want = fleet._WorkloadsFile.model_validate(data).workloads
    except ValidationError:
        with pytest.raises(FleetError):
            fleet._validated(data, Path("w.yaml"), lines)
        return
    got = fleet._validated(data, Path("w.yaml"), lines)
    assert [(spec.__dict__, at.submitted_at, at.stop_at) for spec, at in got] == [
        ({f: getattr(w, f) for f in WorkloadSpec.model_fields}, w.submitted_at, w.stop_at) for w in want]
