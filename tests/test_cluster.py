"""Offline checks of the cluster deployment files (nothing here calls AWS or Kubernetes).

- cluster/aws-c7i.yaml validates against Ray's own cluster-config schema, the way `ray up`
  prepares and validates it.
- A security policy: no ingress rule opens a Ray port or SSH to the internet, the nodes never
  fall back to Ray's auto-created security group (which opens SSH to 0.0.0.0/0), Ray token
  auth is on everywhere, storage lives on /fsx.
- configs/llama3-8b-c7i.yaml asks for worker resources the cluster's node types provide.
- The EKS manifests parse and have the expected kinds and fields.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from raytrain_cpu import plan
from raytrain_cpu.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAML = ROOT / "cluster" / "aws-c7i.yaml"
INFRA_YAML = ROOT / "cluster" / "aws-c7i-infra.yaml"
EKS_DIR = ROOT / "cluster" / "eks"
TRAIN_CONFIG = ROOT / "configs" / "llama3-8b-c7i.yaml"

RAY_PORTS = {6379: "GCS", 8265: "dashboard / jobs", 10001: "Ray client"}
SPOT_OVERRIDES = ["scaling.resources_per_worker={c7i_48xl_spot: 1}"]
SMALL_OVERRIDES = [
    "scaling.resources_per_worker={c7i_8xl: 1}",
    "scaling.cpus_per_worker=28",
    "scaling.data_cpus=4",
    "scaling.num_workers=2",
]


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    return yaml.safe_load(CLUSTER_YAML.read_text())


@pytest.fixture(scope="module")
def infra() -> dict[str, Any]:
    return yaml.safe_load(INFRA_YAML.read_text())


@pytest.fixture(scope="module")
def eks_docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(EKS_DIR.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _all_commands(cluster: dict[str, Any]) -> list[str]:
    keys = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands")
    keys += ("head_start_ray_commands", "worker_start_ray_commands")
    return [cmd for k in keys for cmd in cluster.get(k) or []]


# ----------------------------------------------------------------------------- Ray's schema


def test_cluster_yaml_validates_against_ray_schema(cluster):
    import jsonschema
    import ray.autoscaler
    from ray.autoscaler._private.util import prepare_config, validate_config

    schema_path = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
    jsonschema.validate(cluster, json.loads(schema_path.read_text()))  # the file as written
    # What `ray up` does before it talks to AWS: merge the provider defaults, then validate.
    prepared = prepare_config(copy.deepcopy(cluster))
    validate_config(prepared)
    assert prepared["provider"]["type"] == "aws"
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_node_types_head_spot_and_on_demand(cluster):
    types = cluster["available_node_types"]
    head = types[cluster["head_node_type"]]
    assert head["resources"].get("CPU") == 0, "training must not land on the head"
    workers = {k: v for k, v in types.items() if k != cluster["head_node_type"]}
    instance_types = {v["node_config"]["InstanceType"] for v in workers.values()}
    assert {"c7i.8xlarge", "c7i.48xlarge"} <= instance_types
    spot = [
        v for v in workers.values() if v["node_config"].get("InstanceMarketOptions", {}).get("MarketType") == "spot"
    ]
    on_demand = [v for v in workers.values() if "InstanceMarketOptions" not in v["node_config"]]
    assert spot and on_demand
    for name, t in workers.items():
        assert 0 <= t["min_workers"] <= t["max_workers"], name
        assert t["node_config"].get("Placement", {}).get("GroupName"), f"{name} is not in the cluster placement group"
        assert t["node_config"]["ImageId"] == head["node_config"]["ImageId"], "one AMI for all nodes"


# ----------------------------------------------------------------------------- network policy


def _source_cidrs(rule: dict[str, Any]) -> list[str]:
    cidrs = [r["CidrIp"] for r in rule.get("IpRanges", [])] + [r["CidrIpv6"] for r in rule.get("Ipv6Ranges", [])]
    cidrs += [rule[k] for k in ("CidrIp", "CidrIpv6") if k in rule]
    return [c if isinstance(c, str) else json.dumps(c) for c in cidrs]


def _ports(rule: dict[str, Any]) -> range:
    if str(rule.get("IpProtocol")) in ("-1", "all"):
        return range(0, 65536)
    lo, hi = int(rule.get("FromPort", 0)), int(rule.get("ToPort", 65535))
    return range(0, 65536) if lo == -1 else range(lo, hi + 1)


def _is_internet(cidr: str) -> bool:
    try:
        return ipaddress.ip_network(cidr, strict=False).prefixlen == 0
    except ValueError:
        return False  # a parameter reference such as {"Ref": "SshCidr"}, checked separately


def policy_violations(rules: list[dict[str, Any]]) -> list[str]:
    """What is wrong with a list of EC2 ingress rules (IpPermissions / CloudFormation style)."""
    problems = []
    for rule in rules:
        cidrs, ports = _source_cidrs(rule), _ports(rule)
        for cidr in cidrs:
            for port, what in RAY_PORTS.items():
                if port in ports:
                    problems.append(f"Ray {what} port {port} open to {cidr}")
            if 22 in ports and _is_internet(cidr):
                problems.append(f"SSH open to {cidr}")
            if len(ports) > 1 and ports != range(22, 23):
                problems.append(f"ports {ports.start}-{ports.stop - 1} open to address range {cidr}")
    return problems


def _infra_ingress_rules(infra: dict[str, Any]) -> list[dict[str, Any]]:
    rules = []
    for res in infra["Resources"].values():
        if res["Type"] == "AWS::EC2::SecurityGroup":
            rules += res["Properties"].get("SecurityGroupIngress", [])
        elif res["Type"] == "AWS::EC2::SecurityGroupIngress":
            rules.append(res["Properties"])
    return rules


def test_policy_checker_catches_open_ports():
    # The checker itself: it must flag what the policy forbids and pass what it allows.
    assert policy_violations([{"IpProtocol": "tcp", "FromPort": 8265, "ToPort": 8265, "CidrIp": "0.0.0.0/0"}])
    assert policy_violations([{"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "CidrIp": "0.0.0.0/0"}])
    assert policy_violations([{"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "CidrIpv6": "::/0"}])
    assert policy_violations([{"IpProtocol": "-1", "IpRanges": [{"CidrIp": "10.0.0.0/8"}]}])
    assert policy_violations([{"IpProtocol": "tcp", "FromPort": 6379, "ToPort": 6379, "CidrIp": "203.0.113.7/32"}])
    assert not policy_violations([{"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "CidrIp": "203.0.113.7/32"}])
    assert not policy_violations([{"IpProtocol": "-1", "SourceSecurityGroupId": "sg-123"}])


def test_no_ray_port_or_ssh_open_to_the_internet(cluster, infra):
    rules = cluster["provider"].get("security_group", {}).get("IpPermissions", []) + _infra_ingress_rules(infra)
    assert rules, "no ingress rules found"
    assert policy_violations(rules) == []


def test_every_node_names_its_security_group(cluster):
    # Without SecurityGroupIds, `ray up` creates its default group, which opens SSH to 0.0.0.0/0.
    for name, t in cluster["available_node_types"].items():
        assert t["node_config"].get("SecurityGroupIds"), f"{name} would get Ray's default security group"


def test_cluster_admits_itself_and_lustre(infra):
    sg = next(k for k, r in infra["Resources"].items() if r["Type"] == "AWS::EC2::SecurityGroup")
    self_rules = [r for r in _infra_ingress_rules(infra) if r.get("SourceSecurityGroupId") == {"Ref": sg}]
    assert any(str(r["IpProtocol"]) == "-1" for r in self_rules), "gloo needs every TCP port between nodes"
    lustre = {p for r in self_rules if str(r["IpProtocol"]) == "tcp" for p in _ports(r)}
    assert {988, *range(1018, 1024)} <= lustre
    fsx = next(r for r in infra["Resources"].values() if r["Type"] == "AWS::FSx::FileSystem")
    assert fsx["Properties"]["SecurityGroupIds"] == [{"Ref": sg}]
    pg = next(r for r in infra["Resources"].values() if r["Type"] == "AWS::EC2::PlacementGroup")
    assert pg["Properties"]["Strategy"] == "cluster"


def test_ssh_cidr_is_a_required_parameter_that_refuses_the_internet(infra):
    param = infra["Parameters"]["SshCidr"]
    assert "Default" not in param, "the user must choose the SSH source"
    pattern = re.compile(param["AllowedPattern"])
    assert pattern.match("203.0.113.7/32") and pattern.match("10.0.0.0/8")
    assert not pattern.match("0.0.0.0/0")


# ----------------------------------------------------------------------------- Ray token auth


def test_token_auth_on_every_ray_start(cluster):
    starts = [c for c in cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 2
    for cmd in starts:
        before_start = cmd[: cmd.index("ray start")]
        assert "RAY_AUTH_MODE=token" in before_start, f"no token auth: {cmd}"
    head = next(c for c in cluster["head_start_ray_commands"] if "ray start" in c)
    assert "--dashboard-host=127.0.0.1" in head, "the dashboard must only be reachable through the SSH tunnel"


def test_token_is_shipped_with_file_mounts_not_the_repo(cluster):
    mounts = cluster["file_mounts"]
    assert "~/.ray/auth_token" in mounts, "Ray reads the token from ~/.ray/auth_token on every node"
    local = mounts["~/.ray/auth_token"]
    assert local.startswith("~/.ray/"), "the token must come from outside the repository (never committed)"


# ----------------------------------------------------------------------------- storage on /fsx


def test_training_config_keeps_everything_on_fsx():
    cfg = load_config(TRAIN_CONFIG)
    for key, path in (("run.storage_path", cfg.run.storage_path), ("data.cache_dir", cfg.data.cache_dir)):
        assert Path(path).is_relative_to("/fsx"), f"{key}={path} is not on the shared /fsx file system"


def test_fsx_is_mounted_at_fsx_and_survives_reboots(cluster):
    commands = " ".join(_all_commands(cluster))
    assert "lustre-client-modules-$(uname -r)" in commands
    fstab = re.search(r'echo "(\S+@tcp:/\S+) (\S+) lustre (\S+) 0 0"', commands)
    assert fstab, "FSx must be mounted through /etc/fstab"
    assert fstab.group(2) == "/fsx"
    assert {"_netdev", "flock"} <= set(fstab.group(3).split(","))
    assert "FSX_DNS_NAME=" in commands and "FSX_MOUNT_NAME=" in commands
    for cmd in cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"]:
        for m in re.finditer(r"HF_HOME=(\S+)", cmd):
            assert m.group(1).startswith("/fsx/")


# ----------------------------------------------------------------------------- software pins


def test_setup_installs_the_project_pins(cluster):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {re.split(r"[\[=<>]", d)[0]: d for d in project["dependencies"]}
    commands = " ".join(_all_commands(cluster))
    assert project["requires-python"].startswith(">=3.11") and "python3.11 -m venv" in commands
    assert f"{pins['torch']} --index-url https://download.pytorch.org/whl/cpu" in commands
    ray_pin = re.search(r"==(\S+)", pins["ray"]).group(1)
    assert f'"ray[default,train,data]=={ray_pin}"' in commands, "the cluster's Ray must match the project's pin"
    assert "pip install -q ~/raytrain_cpu" in commands  # the project itself, with all its pins
    mounted = set(cluster["file_mounts"].values())
    assert {"pyproject.toml", "README.md", "raytrain_cpu"} <= mounted


def test_worker_environment_for_cpu_training(cluster):
    worker = next(c for c in cluster["worker_start_ray_commands"] if "ray start" in c)
    env = dict(re.findall(r"\b([A-Z_]+)=(\S+)", worker[: worker.index("ray start")]))
    assert env["LD_PRELOAD"].endswith("libjemalloc.so.2")
    assert "libjemalloc2" in " ".join(cluster["initialization_commands"])
    assert "build-essential" in " ".join(cluster["initialization_commands"])  # model.compile's C++
    assert env["OMP_PROC_BIND"]
    assert "MALLOC_CONF" not in env  # it would win over the training workers' own (cpu.JEMALLOC_CONF)
    assert env["DS_ACCELERATOR"] == "cpu"


def test_every_worker_starts_the_spot_notice_watcher_after_ray(cluster):
    worker = next(c for c in cluster["worker_start_ray_commands"] if "ray start" in c)
    started = worker[worker.index("ray start") :]
    # Only once Ray is up (`&&`, which also keeps a failed `ray start` the command's failure), in
    # the background, with the head's address and the start command's environment (the token mode).
    assert re.search(
        r"ray start [^;&]*&&\s*\(nohup python -m raytrain_cpu\.spot --address=\$RAY_HEAD_IP:6379 .*&\)$", started
    )
    assert "RAY_AUTH_MODE=token" in worker[: worker.index("ray start")]


# ----------------------------------------------------------------------------- resources vs. the run config


def _check_resources_fit(cfg: Config, node_types: dict[str, dict[str, Any]]) -> None:
    """The run's per-worker resources exist on some node type, and those nodes can hold them."""
    s = cfg.scaling
    assert s.resources_per_worker, "the cluster config must pin workers to a node type"
    custom = set(s.resources_per_worker)
    matching = {k: t for k, t in node_types.items() if custom <= set(t["resources"])}
    assert matching, f"no node type declares {sorted(custom)}"
    for name, t in matching.items():
        res = t["resources"]
        ranks_per_node = min(int(res[k] // v) for k, v in s.resources_per_worker.items())
        assert ranks_per_node >= 1, name
        need = s.cpus_per_worker * ranks_per_node + s.data_cpus
        assert res["CPU"] >= need, f"{name}: {res['CPU']} CPUs < {need} (workers + data_cpus)"
        assert t["max_workers"] * ranks_per_node >= s.num_workers, f"{name}: max_workers too small"


@pytest.mark.parametrize("overrides", [[], SPOT_OVERRIDES, SMALL_OVERRIDES], ids=["on-demand", "spot", "small"])
def test_worker_resources_match_cluster(cluster, overrides):
    cfg = load_config(TRAIN_CONFIG, overrides)
    workers = {k: v for k, v in cluster["available_node_types"].items() if k != cluster["head_node_type"]}
    _check_resources_fit(cfg, workers)


def test_resource_check_rejects_a_mismatch(cluster):
    workers = {k: v for k, v in cluster["available_node_types"].items() if k != cluster["head_node_type"]}
    for bad in (["scaling.resources_per_worker={c7i_24xl: 1}"], ["scaling.cpus_per_worker=190"]):
        with pytest.raises(AssertionError):
            _check_resources_fit(load_config(TRAIN_CONFIG, bad), workers)


def test_8b_run_fits_its_node_memory(cluster):
    cfg = load_config(TRAIN_CONFIG)
    est = plan.plan(**plan.inputs_from_run_config(str(TRAIN_CONFIG)))
    node = next(t for t in cluster["available_node_types"].values() if "c7i_48xl" in t["resources"])
    gib = plan.instance_catalog("c7i")[node["node_config"]["InstanceType"]][1]
    assert est["memory_gib"]["peak"] * 2**30 <= plan.usable_bytes(gib)
    assert cfg.scaling.num_workers == est["inputs"]["world_size"]


# ----------------------------------------------------------------------------- EKS


def _kinds(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def _pod_specs(raycluster: dict[str, Any]) -> list[dict[str, Any]]:
    spec = raycluster["spec"]
    return [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]


def test_eks_manifests_parse_with_expected_kinds(eks_docs):
    kinds = _kinds(eks_docs)
    expected = {"RayCluster", "NodePool", "EC2NodeClass", "StorageClass", "PersistentVolumeClaim", "Namespace"}
    assert expected <= set(kinds)
    for d in eks_docs:
        assert d["apiVersion"] and d["metadata"]["name"]
    assert kinds["RayCluster"][0]["apiVersion"] == "ray.io/v1"
    assert kinds["NodePool"][0]["apiVersion"] == "karpenter.sh/v1"
    assert kinds["EC2NodeClass"][0]["apiVersion"] == "karpenter.k8s.aws/v1"


def test_karpenter_nodepool_amx_families_and_taint(eks_docs):
    kinds = _kinds(eks_docs)
    pool = kinds["NodePool"][0]["spec"]["template"]
    reqs = {r["key"]: r for r in pool["spec"]["requirements"]}
    assert set(reqs["karpenter.k8s.aws/instance-family"]["values"]) == {"c7i", "m7i", "r7i"}
    assert {"on-demand", "spot"} <= set(reqs["karpenter.sh/capacity-type"]["values"])
    assert pool["spec"]["nodeClassRef"]["name"] in {d["metadata"]["name"] for d in kinds["EC2NodeClass"]}
    (taint,) = pool["spec"]["taints"]
    assert taint["effect"] == "NoSchedule"
    for pod in _pod_specs(kinds["RayCluster"][0]):
        assert any(t["key"] == taint["key"] and t["effect"] == taint["effect"] for t in pod["tolerations"])


def test_eks_fsx_volume_through_the_csi_driver(eks_docs):
    kinds = _kinds(eks_docs)
    (sc,) = kinds["StorageClass"]
    assert sc["provisioner"] == "fsx.csi.aws.com"
    (pvc,) = kinds["PersistentVolumeClaim"]
    assert pvc["spec"]["storageClassName"] == sc["metadata"]["name"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for pod in _pod_specs(kinds["RayCluster"][0]):
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v
        }
        (container,) = pod["containers"]
        fsx = [m for m in container["volumeMounts"] if claims.get(m["name"]) == pvc["metadata"]["name"]]
        assert fsx and fsx[0]["mountPath"] == "/fsx"


def test_eks_raycluster_secure_and_sized_for_the_8b_config(eks_docs):
    rc = _kinds(eks_docs)["RayCluster"][0]["spec"]
    assert rc["authOptions"]["mode"] == "token"
    assert rc["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP", "no LoadBalancer / NodePort"
    assert rc["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"

    # The worker groups as Ray node types, so the same resource check as the VM cluster applies.
    node_types = {}
    for g in rc["workerGroupSpecs"]:
        res = {"CPU": int(g["rayStartParams"]["num-cpus"]), **json.loads(json.loads(g["rayStartParams"]["resources"]))}
        node_types[g["groupName"]] = {"resources": res, "max_workers": g["maxReplicas"]}
    for overrides in ([], SPOT_OVERRIDES, SMALL_OVERRIDES):
        _check_resources_fit(load_config(TRAIN_CONFIG, overrides), node_types)

    peak_gib = plan.plan(**plan.inputs_from_run_config(str(TRAIN_CONFIG)))["memory_gib"]["peak"]
    for g in rc["workerGroupSpecs"]:
        if "c7i_48xl" in g["rayStartParams"]["resources"]:
            limit = g["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
            assert limit.endswith("Gi") and int(limit[:-2]) >= peak_gib


def test_eks_image_matches_the_pins():
    dockerfile = (EKS_DIR / "Dockerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ray_pin = next(d for d in project["dependencies"] if d.startswith("ray"))
    ray_version = re.search(r"==(\d+\.\d+)", ray_pin).group(1)
    assert re.search(rf"FROM rayproject/ray:{re.escape(ray_version)}\.\d+-py311-cpu", dockerfile)
    assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in dockerfile
    assert "g++" in dockerfile  # model.compile's inductor builds C++ on the workers
