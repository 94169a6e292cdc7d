"""Offline validation of Kubernetes documents for the tests: core kinds with kubernetes-validate
(strict), custom resources against the published schemas in ``../shared/crds`` (made strict the way
the API server's field validation is), skipped with the reason where that folder is absent."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

CRDS = Path(__file__).resolve().parents[3] / "shared" / "crds"
CRD_FILES = {"InferenceService": ("serving.kserve.io_inferenceservices.yaml", "v1beta1"),
             "ClusterServingRuntime": ("serving.kserve.io_clusterservingruntimes.yaml", "v1alpha1")}


def strict(schema: Any) -> Any:
    """A schema that refuses fields it does not declare (except where it preserves unknown fields)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is absent: the published CRD schemas live in ../shared/crds, beside the project")
    return path


@functools.cache
def validator(kind: str) -> Any:
    import jsonschema

    if kind == "VirtualMachine":
        swagger = json.loads(_need(CRDS / "kubevirt" / "swagger.json").read_text())
        schema = {"$ref": "#/definitions/v1.VirtualMachine", "definitions": strict(swagger["definitions"])}
    else:
        name, version = CRD_FILES[kind]
        crd = yaml.safe_load(_need(CRDS / "kserve" / name).read_text())
        [v] = [v for v in crd["spec"]["versions"] if v["name"] == version]
        schema = strict(v["schema"]["openAPIV3Schema"])
    return jsonschema.validators.validator_for(schema)(schema)


def validate(doc: dict[str, Any]) -> None:
    """Raises (jsonschema's or kubernetes-validate's ValidationError) when ``doc`` is not valid."""
    import kubernetes_validate

    if doc["kind"] in ("VirtualMachine", *CRD_FILES):
        validator(doc["kind"]).validate(doc)
    else:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
