"""Vendor a small JSON schema of a custom resource from its CustomResourceDefinition, for the manifest tests.

    python scripts/vendor_crd_schema.py CRD.yaml VERSION OUT.json

Takes the version's openAPIV3Schema, drops `status` (never written by a manifest), and replaces every pod
`template` (a whole PodTemplateSpec, most of the CRD's size) by a marker: the tests validate those templates against
the Kubernetes schema of PodTemplate instead. The CRDs come from the operators' repositories (KubeRay's
ray-operator/config/crd/bases, KEDA's config/crd/bases).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

POD_TEMPLATE = {"type": "object", "x-pod-template": True}


def prune(node, path=()):
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "properties" and isinstance(value, dict):
                out[key] = {name: (POD_TEMPLATE if name == "template" and "spec" in (sub.get("properties") or {})
                                   else prune(sub, path + (name,)))
                            for name, sub in value.items() if not (name == "status" and len(path) == 0)}
            elif key.startswith("x-kubernetes-") or key == "description":
                continue
            else:
                out[key] = prune(value, path)
        return out
    if isinstance(node, list):
        return [prune(v, path) for v in node]
    return node


def main(crd: str, version: str, out: str) -> None:
    doc = yaml.safe_load(Path(crd).read_text())
    [entry] = [v for v in doc["spec"]["versions"] if v["name"] == version]
    schema = prune(entry["schema"]["openAPIV3Schema"])
    schema["x-source"] = f"{doc['metadata']['name']} {version}"
    Path(out).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
