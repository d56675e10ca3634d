"""docs/install.md followed line by line: the shell blocks of "Install the operator" and
"A first PDCluster on one 8-GPU node", read from the Markdown, run in order against the
real-vLLM local cluster (its pod runner runs the project's images and vLLM's on the tiny
model), up to a PDCluster that answers the doc's request.

Only placeholders are replaced: `<registry>/<project>` by a registry path whose images
the pod runner runs (it ignores the registry host), `<token>` by a dummy. Each command runs
with bash in the repository root as the doc prints it, against a kubeconfig whose current
namespace is a fresh one (the doc names none), so what a user types is what runs here."""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from markdown_it import MarkdownIt

from pdcluster import constants as C

pytestmark = [pytest.mark.cluster, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "install.md"
SECTIONS = ("Install the operator", "A first PDCluster on one 8-GPU node")
REGISTRY_PATH = "localhost:5000/pdcluster"  # the pod runner ignores the registry host
PLACEHOLDERS = {"<registry>/<project>": REGISTRY_PATH, "<token>": "hf_dummy_token"}
COMMAND_TIMEOUT_S = 120
READY_TIMEOUT_S = 900  # two engines start in about 90 s each on two cores, longer beside other work
OPERATOR_NAMESPACE = "pdcluster-system"  # the doc's `helm install --namespace`


def shell_blocks(markdown: str, heading: str) -> list[str]:
    """The `sh` fences of the second-level section titled `heading`."""
    tokens = MarkdownIt().parse(markdown)
    section, blocks = None, []
    for i, token in enumerate(tokens):
        if token.type == "heading_open" and token.tag == "h2":
            section = tokens[i + 1].content
        elif token.type == "fence" and token.info.strip() == "sh" and section == heading:
            blocks.append(token.content)
    return blocks


def commands(block: str) -> list[str]:
    """One entry per command: continuation lines joined, as bash would read them."""
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def substituted(command: str) -> str:
    for placeholder, value in PLACEHOLDERS.items():
        command = command.replace(placeholder, value)
    return command


def without_comment(command: str) -> str:
    return re.sub(r"\s+#.*$", "", command)


def test_the_doc_has_the_commands_this_test_runs() -> None:
    """Guards the parser: the sections exist and hold the steps the test relies on."""
    steps = [c for s in SECTIONS for b in shell_blocks(DOC.read_text(), s) for c in commands(b)]
    firsts = [c.split()[:2] for c in steps]
    assert ["helm", "install"] in firsts and ["kubectl", "apply"] in firsts and ["curl", "-s"] in firsts
    assert any(without_comment(c).endswith(" -w") for c in steps)
    assert all("\\" not in c for c in steps), "a continuation line was not joined"


class Shell:
    """Runs the doc's commands as a user would, against one namespace of the cluster."""

    def __init__(self, cluster: Any, namespace: str, home: Path) -> None:
        config = yaml.safe_load(Path(cluster.kubeconfig).read_text())
        for context in config["contexts"]:
            context["context"]["namespace"] = namespace
        kubeconfig = home / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(config))
        # curl reads $CURL_HOME/.curlrc: the status code is printed without touching the command.
        (home / ".curlrc").write_text('write-out = "\\n%{http_code}\\n"\n')
        path = f"{cluster.bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PATH": path, "CURL_HOME": str(home)}
        self.rewrites: dict[str, str] = {}

    def run(self, command: str, timeout: float = COMMAND_TIMEOUT_S, echo: bool = True) -> str:
        for old, new in self.rewrites.items():
            command = command.replace(old, new)
        print(f"$ {command}")
        out = subprocess.run(
            ["bash", "-c", command], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        print(out.stdout + out.stderr if echo else out.stderr)
        assert out.returncode == 0, f"{command}\n{out.stdout}{out.stderr}"
        return out.stdout

    def watch_until_ready(self, command: str) -> None:
        """`kubectl get ... -w` until its READY column says True, within READY_TIMEOUT_S."""
        print(f"$ {command}")
        proc = subprocess.Popen(
            ["bash", "-c", command], cwd=REPO, env=self.env, stdout=subprocess.PIPE, text=True
        )
        deadline, header, seen = time.monotonic() + READY_TIMEOUT_S, None, []
        try:
            while time.monotonic() < deadline:
                readable, _, _ = select.select([proc.stdout], [], [], 5)
                if not readable:
                    continue
                line = proc.stdout.readline()
                assert line, f"the watch ended: {seen}"
                seen.append(line.rstrip())
                print(line.rstrip())
                # Columns are padded and may be empty: READY is read where its header starts.
                if header is None:
                    column = line.index("READY")
                    header = line
                elif line[column:].startswith("True"):
                    return
            raise AssertionError(f"not READY True within {READY_TIMEOUT_S} s: {seen}")
        finally:
            proc.kill()
            proc.wait()

    def instead_of_port_forward(self, command: str) -> None:
        """The pod runner serves no kubelet API (no port-forward, logs or exec: e2e/local/README.md).
        Making it work is not cheap: the apiserver would need a kubelet endpoint over TLS at every
        fake node's address (kwok's own server has one listen address, `--server-address`) that
        forwards to each pod's IP. So the router Service is reached at its ClusterIP, which the pod
        runner proxies, as the other e2e tests do; the doc's `localhost:<port>` means that address."""
        m = re.search(r"port-forward\s+(?:svc|service)/(\S+)\s+(\d+):(\d+)", command)
        assert m, command
        service, local, remote = m.groups()
        ip = self.run(f"kubectl get svc {service} -o jsonpath='{{.spec.clusterIP}}'").strip()
        self.rewrites[f"localhost:{local}"] = f"{ip}:{remote}"


@pytest.fixture
def shell(vllm_cluster: Any, tmp_path: Path) -> Iterator[Shell]:
    namespace = f"installdoc-{uuid.uuid4().hex[:5]}"
    sh = Shell(vllm_cluster, namespace, tmp_path)
    sh.run(f"kubectl create namespace {namespace}")
    try:
        yield sh
    finally:
        # The doc's objects go, and their pods with them, before the next module needs the GPUs.
        sh.run(f"helm uninstall pdcluster-operator -n {OPERATOR_NAMESPACE} --wait --ignore-not-found")
        sh.run(f"kubectl delete namespace {namespace} {OPERATOR_NAMESPACE} --ignore-not-found --wait=false")
        sh.run(f"kubectl delete pods -n {namespace} --all --wait=true", timeout=180)


def pods(shell: Shell, selector: str, namespace: str = "") -> list[dict[str, Any]]:
    where = f"-n {namespace}" if namespace else ""
    return json.loads(shell.run(f"kubectl get pods {where} -l {selector} -o json", echo=False))["items"]


def check_what_the_doc_says_of_the_pods(shell: Shell) -> None:
    """The doc's comments: two operator replicas, one holding the Lease; images from the
    chart's values; one GPU per engine pod; two routers."""
    operators = pods(shell, "app.kubernetes.io/instance=pdcluster-operator", OPERATOR_NAMESPACE)
    assert len(operators) == 2
    lease = json.loads(
        shell.run(f"kubectl get lease pdcluster-operator -n {OPERATOR_NAMESPACE} -o json", echo=False)
    )
    assert any(lease["spec"]["holderIdentity"].startswith(p["metadata"]["name"]) for p in operators), lease
    assert all(p["spec"]["containers"][0]["image"].startswith(REGISTRY_PATH) for p in operators)
    by_role: dict[str, list[str]] = {}
    for pod in pods(shell, f"{C.LABEL_CLUSTER}=llama-tcp"):
        role = pod["metadata"]["labels"].get(C.LABEL_ROLE, "")
        container = pod["spec"]["containers"][0]
        by_role.setdefault(role, []).append(container["image"])
        if role in C.ENGINE_ROLES:
            assert container["resources"]["limits"]["nvidia.com/gpu"] == "1", container["resources"]
    engine = f"{REGISTRY_PATH}/engine:0.1.0"
    assert by_role[C.ROLE_PREFILL] == [engine] and by_role[C.ROLE_DECODE] == [engine], by_role
    routers = by_role[C.ROLE_ROUTER]
    assert len(routers) == 2 and all(i.startswith(f"{REGISTRY_PATH}/router:") for i in routers)


@pytest.mark.timeout(READY_TIMEOUT_S + 300)
def test_install_doc_line_by_line_up_to_a_serving_pdcluster(shell: Shell) -> None:
    markdown = DOC.read_text()
    steps = [c for s in SECTIONS for b in shell_blocks(markdown, s) for c in commands(b)]
    answer = None
    for step in map(substituted, steps):
        command = without_comment(step)
        assert "<" not in command.replace("<<", ""), f"a placeholder is left: {command}"
        if " port-forward " in command:
            shell.instead_of_port_forward(command)
        elif command.endswith(" -w"):
            shell.watch_until_ready(command)
        else:
            answer = shell.run(step)
    assert steps[-1].startswith("curl"), "the doc ends with its request"
    check_what_the_doc_says_of_the_pods(shell)
    body, status = answer.rstrip("\n").rsplit("\n", 1)  # the status line is the .curlrc's
    assert status == "200", answer
    completion = json.loads(body)
    assert completion["choices"][0]["text"], completion
    usage = completion["usage"]
    assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] <= 16
    # The field the doc points the reader to after the request.
    assert "usage.prompt_tokens_details.cached_tokens" in markdown
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0
