"""docs/deploy.md says what the chart, the CRD and the operator really do: the files it
names exist, the object names match `helm install kvfleet`, the HPA snippet is a valid
autoscaling/v2 object on the metric the adapter rule and the operator use, and the sample
`kubectl get` output has the CRD's printer columns."""

from __future__ import annotations

import copy
import re
import subprocess
import textwrap

import kubernetes_validate
import yaml
from support.paths import ROOT

DOC = ROOT / "docs" / "deploy.md"
CHART = ROOT / "charts" / "kvfleet"


def text() -> str:
    return DOC.read_text()


def crd() -> dict:
    return yaml.safe_load((ROOT / "crds" / "inferenceservices.kvfleet.io.yaml").read_text())


def test_named_files_exist():
    paths = set(re.findall(r"\b((?:examples|charts|docs|crds)/[\w./-]*\w)", text()))
    assert "examples/inferenceservice-minimal.yaml" in paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing


def test_hpa_snippet_matches_the_adapter_rule_and_the_operator():
    from kvfleet.operator import hpa as hpa_mode

    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text(), flags=re.S)]
    (hpa,) = [b for b in blocks if isinstance(b, dict) and b.get("kind") == "HorizontalPodAutoscaler"]
    kubernetes_validate.validate(hpa, "1.35.0", strict=True)
    c = crd()
    ref = hpa["spec"]["scaleTargetRef"]
    assert ref["apiVersion"] == f"{c['spec']['group']}/{c['spec']['versions'][0]['name']}"
    assert ref["kind"] == c["spec"]["names"]["kind"]
    rules = yaml.safe_load((CHART / "files" / "prometheus-adapter-rules.yaml").read_text())["rules"]
    assert [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]] == [r["name"]["as"] for r in rules] == [
        hpa_mode.HPA_METRIC, hpa_mode.HPA_KV_METRIC]
    # Same shape as the HPA the operator builds in mode hpa.
    built = hpa_mode.build_hpa({"metadata": {"name": ref["name"], "namespace": "default"},
                              "spec": {"autoscaling": {"mode": "hpa", "minReplicas": 1, "maxReplicas": 4,
                                                       "targetQueueDepth": 4}}})
    assert built["spec"]["metrics"] == hpa["spec"]["metrics"]
    assert built["spec"]["scaleTargetRef"] == ref


def test_sample_kubectl_get_output_has_the_printer_columns():
    columns = [col["name"].upper() for col in crd()["spec"]["versions"][0]["additionalPrinterColumns"]
               if col.get("priority", 0) == 0]
    header = next(line for line in text().splitlines() if line.startswith("NAME "))
    assert header.split() == ["NAME", *columns]
    assert "kis" in crd()["spec"]["names"]["shortNames"] and "short name: kis" in text()


def test_names_in_the_doc_are_what_helm_install_kvfleet_creates(helm_bin):
    out = subprocess.run([helm_bin, "template", "kvfleet", str(CHART), "-n", "kvfleet-system"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    names = {(o["kind"], o["metadata"]["name"]) for o in yaml.safe_load_all(out) if o}
    for kind, name in [("Deployment", "kvfleet"), ("ConfigMap", "kvfleet-prometheus-adapter"),
                       ("ConfigMap", "kvfleet-dashboard")]:
        assert (kind, name) in names
        assert name in text()
    # The namespaced install command in the doc renders.
    (sets,) = re.findall(r"--set '(operator\.watchNamespaces=\{[^}]*\})'", text())
    subprocess.run([helm_bin, "template", "kvfleet", str(CHART), "--set", sets], capture_output=True,
                   text=True, timeout=120, check=True)


def test_label_used_to_list_children_is_set_by_the_operator():
    from kvfleet.operator import service_spec

    (label,) = set(re.findall(r"-l ([\w./-]+)=smollm2", text()))
    isvc = yaml.safe_load((ROOT / "examples" / "inferenceservice-minimal.yaml").read_text())
    assert service_spec.labels(isvc)[label] == "smollm2"


def _served_model_name(isvc: dict) -> str:
    from kvfleet.operator import builders

    isvc = copy.deepcopy(isvc)
    isvc["metadata"].setdefault("namespace", "default")
    isvc["metadata"].update(uid="0b8e5a2c-7f0e-4c71-9d51-3c1f6f0f1a11", generation=1)
    return builders.engine_config(isvc)["served_model_name"]


def test_curl_examples_use_the_served_model_name(helm_bin):
    # docs/deploy.md: the minimal example, as applied.
    isvc = yaml.safe_load((ROOT / "examples" / "inferenceservice-minimal.yaml").read_text())
    (model,) = re.findall(r'"model": "([^"]+)"', text())
    assert model == _served_model_name(isvc)
    # NOTES.txt: the manifest it prints, and its curl.
    notes = subprocess.run([helm_bin, "install", "kvfleet", str(CHART), "--dry-run=client"], capture_output=True,
                           text=True, timeout=120, check=True).stdout.split("NOTES:", 1)[1]
    block = notes.split("-f -\n", 1)[1].split("YAML\n", 1)[0]
    isvc = yaml.safe_load(textwrap.dedent(block))
    (model,) = re.findall(r'"model": "([^"]+)"', notes)
    assert model == _served_model_name(isvc)


def test_readme_deploy_block_is_turnkey():
    """README's deploy block: images pushed (or loaded), the chart pointed at them (the runtime
    image too), the openai client installed before it is used, with the served model name."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Deploy on Kubernetes", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert "docker push" in block and "kind load docker-image" in block
    assert "runtimeImage.repository=" in block and "image.repository=" in block
    assert block.index("pip install openai") < block.index("from openai import OpenAI")
    (model,) = re.findall(r'model="([^"]+)"', block)
    isvc = yaml.safe_load((ROOT / "examples" / "inferenceservice-minimal.yaml").read_text())
    assert model == _served_model_name(isvc)
