"""Offline checks of the cluster deployment files (nothing here calls AWS or Kubernetes).

- cluster/aws-c7i.yaml validates against Ray's own cluster-config schema, the way `ray up`
  prepares and validates it.
- A security policy: no ingress rule opens a Ray port or SSH to the internet, the nodes never
  fall back to Ray's auto-created security group (which opens SSH to 0.0.0.0/0), Ray token
  auth is on everywhere, storage lives on /fsx.
- configs/llama3-8b-c7i.yaml asks for worker resources the cluster's node types provide.
- The EKS manifests parse and have the expected kinds and fields.
- Least privilege (issue 59): the infra template read as CloudFormation reads it (short-form
  intrinsic tags understood, intrinsics resolved for given parameters), so the IAM policies checked
  are the ones AWS would receive; IMDSv2 on every node; the Hugging Face token as a 0600 file on
  the nodes, never in a job's runtime env; the spot watcher on EKS's spot pods too.
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

from raytrain_cpu.config.schema import Config, load_config
from raytrain_cpu.planner import plan
from raytrain_cpu.planner import tables as plan_tables

ROOT = Path(__file__).resolve().parents[2]
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
    return cfn_load(INFRA_YAML.read_text())


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


def test_ssh_cidr_is_a_required_parameter_that_refuses_wider_than_a_16(infra):
    param = infra["Parameters"]["SshCidr"]
    assert "Default" not in param, "the user must choose the SSH source"
    # CloudFormation matches AllowedPattern against the whole value (Java's String.matches).
    pattern = re.compile(param["AllowedPattern"])
    for ok in ("203.0.113.7/32", "198.51.100.0/24", "10.20.0.0/16", "172.16.0.0/20"):
        assert pattern.fullmatch(ok), ok
    for wide in ("0.0.0.0/0", "0.0.0.0/1", "10.0.0.0/8", "10.0.0.0/15", "128.0.0.0/1"):
        assert not pattern.fullmatch(wide), f"{wide} is wider than an office or VPN range"
    for bad in ("203.0.113.7", "203.0.113.7/33", "300.1.1.1/32", "10.0.0/16", "10.0.0.0/16 "):
        assert not pattern.fullmatch(bad), bad
    assert "/16" in param["ConstraintDescription"]


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
    gib = plan_tables.instance_catalog("c7i")[node["node_config"]["InstanceType"]][1]
    assert est["memory_gib"]["peak"] * 2**30 <= plan_tables.usable_bytes(gib)
    assert cfg.scaling.num_workers == est["inputs"]["world_size"]


@pytest.mark.parametrize("name", ["llama3-8b-c7i", "llama3-8b-lora-c7i", "llama3-8b-dpo-c7i"])
def test_8b_configs_take_the_planners_fastest_topology(name):
    """Each 8B config runs what `plan --config` recommends by time: its node, a rank a socket,
    and the variant's settings."""
    path = ROOT / "configs" / f"{name}.yaml"
    cfg = load_config(path)
    best = plan.plan(**plan.inputs_from_run_config(str(path)))["recommended_by_time"]
    assert best["instance"] == cfg.scaling.instance_type
    assert best["ranks_per_node"] == plan_tables.sockets_of(cfg.scaling.instance_type) == 2
    assert best["nodes"] * best["ranks_per_node"] == cfg.scaling.num_workers
    for setting in best["settings"]:
        key, value = setting.split("=")
        section, field = key.split(".")
        assert str(getattr(getattr(cfg, section), field)) == value, (name, setting)
    assert cfg.deepspeed.cross_node_collectives == ("striped" if "striped" in best["variant"] else "gloo")


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
        container = pod["containers"][0]  # the Ray container (KubeRay's default); a spot pod has the watcher too
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


# ----------------------------------------------------------------------------- CloudFormation as AWS reads it


class _CfnLoader(yaml.SafeLoader):
    """YAML as CloudFormation reads it: the short-form intrinsic tags (!Ref, !Sub, !GetAtt, ...)
    become their long forms ({"Ref": ...}, {"Fn::Sub": ...}), so a template may use either."""


def _intrinsic(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> dict[str, Any]:
    name = suffix if suffix in ("Ref", "Condition") else f"Fn::{suffix}"
    if isinstance(node, yaml.ScalarNode):
        value: Any = loader.construct_scalar(node)
        if suffix == "GetAtt":  # !GetAtt Resource.Attribute
            value = value.split(".", 1)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)
    return {name: value}


_CfnLoader.add_multi_constructor("!", _intrinsic)


def cfn_load(text: str) -> dict[str, Any]:
    return yaml.load(text, Loader=_CfnLoader)  # noqa: S506 - a SafeLoader with the intrinsic tags added


PSEUDO = {"AWS::Region": "us-east-1", "AWS::AccountId": "123456789012", "AWS::Partition": "aws"}
_NO_VALUE = object()


class Template:
    """A template with its parameters set, its intrinsic functions resolved as CloudFormation does
    (Ref of a resource: a placeholder '<Name>'; Fn::GetAtt: '<Name.Attribute>')."""

    def __init__(self, doc: dict[str, Any], **params: Any) -> None:
        self.doc = doc
        self.params = {}
        for name, p in doc["Parameters"].items():
            value = params.get(name, p.get("Default"))
            assert value is not None, f"parameter {name} has no default: pass it"
            if p["Type"] == "CommaDelimitedList" and isinstance(value, str):
                value = [v.strip() for v in value.split(",")] if value else [""]
            self.params[name] = value
        self.conditions = {k: self.eval(v) for k, v in doc.get("Conditions", {}).items()}

    def ref(self, name: str) -> Any:
        if name == "AWS::NoValue":
            return _NO_VALUE
        if name in PSEUDO:
            return PSEUDO[name]
        if name in self.params:
            return self.params[name]
        assert name in self.doc["Resources"], f"Ref to unknown {name}"
        return f"<{name}>"

    def sub(self, text: str, names: dict[str, Any]) -> str:
        def one(m: re.Match[str]) -> str:
            key = m.group(1)
            if key in names:
                return str(names[key])
            if "." in key:
                return f"<{key}>"
            value = self.ref(key)
            assert isinstance(value, str), f"${{{key}}} in Fn::Sub is not a string"
            return value

        return re.sub(r"\$\{([^}!]+)\}", one, text)

    def eval(self, node: Any) -> Any:
        if isinstance(node, list):
            return [v for v in (self.eval(x) for x in node) if v is not _NO_VALUE]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            ((fn, arg),) = node.items()
            if fn == "Ref":
                return self.ref(arg)
            if fn == "Condition":
                return self.conditions[arg]
            if fn == "Fn::GetAtt":
                assert arg[0] in self.doc["Resources"], f"GetAtt of unknown {arg[0]}"
                return f"<{arg[0]}.{arg[1]}>"
            if fn == "Fn::Sub":
                text, names = (arg, {}) if isinstance(arg, str) else (arg[0], self.eval(arg[1]))
                return self.sub(text, names)
            if fn == "Fn::Join":
                return self.eval(arg[0]).join(self.eval(arg[1]))
            if fn == "Fn::Split":
                return self.eval(arg[1]).split(self.eval(arg[0]))
            if fn == "Fn::Select":
                return self.eval(arg[1])[int(self.eval(arg[0]))]
            if fn == "Fn::If":
                return self.eval(arg[1] if self.conditions[arg[0]] else arg[2])
            if fn == "Fn::Equals":
                return self.eval(arg[0]) == self.eval(arg[1])
            if fn == "Fn::Not":
                return not self.eval(arg[0])
            if fn == "Fn::And":
                return all(self.eval(a) for a in arg)
            if fn == "Fn::Or":
                return any(self.eval(a) for a in arg)
            assert not fn.startswith("Fn::"), f"the test's evaluator does not know {fn}"
        return {k: v for k, v in ((k, self.eval(v)) for k, v in node.items()) if v is not _NO_VALUE}

    def resource(self, name: str) -> dict[str, Any]:
        return self.eval(self.doc["Resources"][name])


def _statements(role: dict[str, Any]) -> list[dict[str, Any]]:
    """Every statement of a resolved AWS::IAM::Role's inline policies, Action and Resource as lists."""
    out = []
    for policy in role["Properties"].get("Policies", []):
        for st in policy["PolicyDocument"]["Statement"]:
            assert st["Effect"] == "Allow" and "NotAction" not in st and "NotResource" not in st
            as_list = lambda v: v if isinstance(v, list) else [v]  # noqa: E731
            out.append({**st, "Action": as_list(st["Action"]), "Resource": as_list(st["Resource"])})
    return out


def _role_of_profile(tpl: Template, profile: str) -> str:
    (role,) = tpl.resource(profile)["Properties"]["Roles"]
    return role.strip("<>")


def _worker_instance_types(cluster: dict[str, Any]) -> set[str]:
    head = cluster["head_node_type"]
    return {t["node_config"]["InstanceType"] for k, t in cluster["available_node_types"].items() if k != head}


ARN = "arn:aws:ec2:us-east-1:123456789012"
BUCKETS = "raytrain-data,raytrain-out"
BUCKET_ARNS = {"arn:aws:s3:::raytrain-data", "arn:aws:s3:::raytrain-out"}
OBJECT_ARNS = {"arn:aws:s3:::raytrain-data/*", "arn:aws:s3:::raytrain-out/*"}
# Actions AWS grants on no resource but "*" (IAM's service authorization reference).
UNSCOPABLE = {"ec2:DescribeInstances", "ec2:DescribeInstanceTypes", "ec2:DescribeImages"}


def test_the_template_resolves_completely(infra):
    # Every intrinsic resolves and leaves no ${...} behind: Fn::Sub substitutes only its own string,
    # not what Fn::Join puts in its variables, so a ${AWS::Partition} there would reach AWS as is.
    for buckets in (BUCKETS, ""):
        tpl = Template(infra, VpcId="vpc-1", SubnetId="subnet-1", SshCidr="203.0.113.7/32", DataBuckets=buckets)
        resolved = json.dumps([tpl.eval(infra["Resources"]), tpl.eval(infra["Outputs"])])
        assert "${" not in resolved and '"Fn::' not in resolved and '"Ref"' not in resolved


def test_the_loader_reads_short_form_intrinsics():
    doc = cfn_load(
        "A: !Ref X\nB: !GetAtt Role.Arn\nC: !Sub 'arn:${AWS::Partition}:s3:::${B}'\n"
        "D: !If [Cond, !Join [',', !Ref L], !Ref AWS::NoValue]\nE: !Split [',', !Select [0, !Ref L]]\n"
    )
    assert doc == {
        "A": {"Ref": "X"},
        "B": {"Fn::GetAtt": ["Role", "Arn"]},
        "C": {"Fn::Sub": "arn:${AWS::Partition}:s3:::${B}"},
        "D": {"Fn::If": ["Cond", {"Fn::Join": [",", {"Ref": "L"}]}, {"Ref": "AWS::NoValue"}]},
        "E": {"Fn::Split": [",", {"Fn::Select": [0, {"Ref": "L"}]}]},
    }


def test_every_node_type_has_its_own_instance_profile_from_the_stack(cluster, infra):
    tpl = Template(infra, VpcId="vpc-1", SubnetId="subnet-1", SshCidr="203.0.113.7/32")
    outputs = {k: tpl.eval(v["Value"]) for k, v in infra["Outputs"].items()}
    assert outputs["HeadInstanceProfileArn"] == "<HeadInstanceProfile.Arn>"
    assert outputs["WorkerInstanceProfileArn"] == "<WorkerInstanceProfile.Arn>"
    assert _role_of_profile(tpl, "HeadInstanceProfile") == "HeadRole"
    assert _role_of_profile(tpl, "WorkerInstanceProfile") == "WorkerRole"

    meta = cluster["metadata"]
    assert meta["head_profile"] != meta["worker_profile"]
    for name, t in cluster["available_node_types"].items():
        want = meta["head_profile"] if name == cluster["head_node_type"] else meta["worker_profile"]
        assert t["node_config"].get("IamInstanceProfile") == {"Arn": want}, f"{name}: not its own profile"


def test_ray_up_attaches_no_default_instance_profile(cluster):
    # What `ray up` does: with the head's profile named, Ray creates and attaches no ray-autoscaler-v1.
    pytest.importorskip("boto3")  # Ray's AWS bootstrap imports it (the project's [aws] extra)
    from ray.autoscaler._private.aws.config import _configure_iam_role
    from ray.autoscaler._private.util import prepare_config

    prepared = prepare_config(copy.deepcopy(cluster))
    _configure_iam_role(prepared)  # returns before any AWS call when the head names its profile
    assert "IamInstanceProfile" not in prepared.get("head_node", {})


def test_the_stack_matches_the_ray_cluster(cluster, infra):
    params = infra["Parameters"]
    assert params["ClusterName"]["Default"] == cluster["cluster_name"], "Ray tags nodes ray-cluster-name=<cluster_name>"
    assert re.fullmatch(params["ClusterName"]["AllowedPattern"], cluster["cluster_name"])
    assert set(params["WorkerInstanceTypes"]["Default"].split(",")) == _worker_instance_types(cluster)


@pytest.mark.parametrize("buckets", [BUCKETS, ""], ids=["buckets", "no-buckets"])
def test_the_heads_policy_is_least_privilege(cluster, infra, buckets):
    tpl = Template(infra, VpcId="vpc-1", SubnetId="subnet-1", SshCidr="203.0.113.7/32", DataBuckets=buckets)
    statements = _statements(tpl.resource("HeadRole"))
    by_action: dict[str, list[dict[str, Any]]] = {}
    for st in statements:
        for action in st["Action"]:
            assert "*" not in action, f"a wildcard action: {action}"
            by_action.setdefault(action, []).append(st)
        if "*" in st["Resource"]:
            assert st["Resource"] == ["*"] and set(st["Action"]) <= UNSCOPABLE, f"'*' for {st['Action']}"
    expected = {"ec2:RunInstances", "ec2:CreateTags", "ec2:TerminateInstances", "iam:PassRole", *UNSCOPABLE}
    s3_read = {"s3:ListBucket", "s3:GetBucketLocation", "s3:GetObject"}
    assert set(by_action) == expected | (s3_read if buckets else set())

    cluster_tag = {"ec2:ResourceTag/ray-cluster-name": cluster["cluster_name"]}
    instances = f"{ARN}:instance/*"
    # Launch: the instance carries the cluster's tag and is a worker type; everything else it
    # touches is this stack's network (or what a launch creates with it).
    (launch_instance,) = [st for st in by_action["ec2:RunInstances"] if instances in st["Resource"]]
    assert launch_instance["Resource"] == [instances]
    assert launch_instance["Condition"] == {
        "StringEquals": {
            "aws:RequestTag/ray-cluster-name": cluster["cluster_name"],
            "ec2:InstanceType": sorted(_worker_instance_types(cluster), key=["c7i.8xlarge", "c7i.48xlarge"].index),
        }
    }
    (launch_rest,) = [st for st in by_action["ec2:RunInstances"] if st is not launch_instance]
    assert set(launch_rest["Resource"]) == {
        f"{ARN}:subnet/subnet-1",
        f"{ARN}:security-group/<ClusterSecurityGroup>",
        f"{ARN}:placement-group/<ClusterPlacementGroup>",
        f"{ARN}:key-pair/ray-autoscaler_*",  # the key pair `ray up` makes (ray-autoscaler_<region>)
        f"{ARN}:network-interface/*",
        f"{ARN}:volume/*",
        f"{ARN}:spot-instances-request/*",
        "arn:aws:ec2:us-east-1::image/*",
    }
    # Tags: at launch, or on instances of this cluster, never the cluster tag itself.
    tagging = {json.dumps(st["Condition"], sort_keys=True) for st in by_action["ec2:CreateTags"]}
    assert all(st["Resource"] == [instances] for st in by_action["ec2:CreateTags"])
    assert tagging == {
        json.dumps({"StringEquals": {"ec2:CreateAction": "RunInstances"}}, sort_keys=True),
        json.dumps(
            {"StringEquals": cluster_tag, "ForAllValues:StringNotEquals": {"aws:TagKeys": ["ray-cluster-name"]}},
            sort_keys=True,
        ),
    }
    (terminate,) = by_action["ec2:TerminateInstances"]
    assert terminate["Resource"] == [instances] and terminate["Condition"] == {"StringEquals": cluster_tag}
    (pass_role,) = by_action["iam:PassRole"]
    assert pass_role["Action"] == ["iam:PassRole"] and pass_role["Resource"] == ["<WorkerRole.Arn>"]
    assert pass_role["Condition"] == {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}}
    if buckets:  # the job's driver lists s3:// sources: read, never write
        (read,) = {id(st): st for a in s3_read for st in by_action[a]}.values()
        assert set(read["Resource"]) == BUCKET_ARNS | OBJECT_ARNS


@pytest.mark.parametrize("buckets", [BUCKETS, "raytrain-data", ""], ids=["two", "one", "none"])
def test_the_workers_policy_is_the_named_buckets_only(infra, buckets):
    tpl = Template(infra, VpcId="vpc-1", SubnetId="subnet-1", SshCidr="203.0.113.7/32", DataBuckets=buckets)
    role = tpl.resource("WorkerRole")
    trust = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    assert trust == [{"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]
    statements = _statements(role)
    if not buckets:
        assert statements == [], "no buckets named: the workers get no AWS rights at all"
        return
    names = buckets.split(",")
    granted = {(a, r) for st in statements for a in st["Action"] for r in st["Resource"]}
    bucket_level = {"s3:ListBucket", "s3:GetBucketLocation"}
    object_level = {"s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload"}
    assert granted == {(a, f"arn:aws:s3:::{b}") for a in bucket_level for b in names} | {
        (a, f"arn:aws:s3:::{b}/*") for a in object_level for b in names
    }
    assert not any("Condition" in st for st in statements)


def test_imdsv2_with_a_hop_limit_for_containers_on_every_node_type(cluster):
    for name, t in cluster["available_node_types"].items():
        assert t["node_config"].get("MetadataOptions") == {
            "HttpEndpoint": "enabled",
            "HttpTokens": "required",  # IMDSv2: no metadata (or credentials) without a session token
            "HttpPutResponseHopLimit": 2,  # the spot watcher and processes in containers are one hop further
        }, name


def test_node_configs_are_valid_run_instances_requests(cluster):
    # What Ray's AWS provider sends: the node_config with SubnetIds resolved to one SubnetId, plus
    # MinCount, MaxCount and TagSpecifications, checked against EC2's own API model.
    botocore_session = pytest.importorskip("botocore.session")
    from botocore.validate import ParamValidator

    model = botocore_session.get_session().get_service_model("ec2").operation_model("RunInstances").input_shape
    for name, t in cluster["available_node_types"].items():
        conf = copy.deepcopy(t["node_config"])
        conf["SubnetId"] = conf.pop("SubnetIds")[0]
        conf |= {"MinCount": 1, "MaxCount": 1, "TagSpecifications": [{"ResourceType": "instance", "Tags": []}]}
        report = ParamValidator().validate(conf, model)
        assert not report.has_errors(), f"{name}: {report.generate_report()}"


def test_the_hf_token_is_a_0600_file_on_each_node_not_in_the_job(cluster, tmp_path, monkeypatch):
    mounts = cluster["file_mounts"]
    remote = "~/.cache/huggingface/token"
    assert mounts.get(remote) == "~/.cache/huggingface/token", "the file `hf auth login` writes, from outside the repo"
    chmod = " ".join(cluster["setup_commands"])
    assert re.search(r"chmod 600 [^&;]*~/\.cache/huggingface/token", chmod)
    assert re.search(r"chmod 700 [^&;]*~/\.cache/huggingface\b", chmod)
    assert re.search(r"chmod 600 [^&;]*~/\.ray/auth_token", chmod)
    for cmd in [
        c for c in cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"] if "ray start" in c
    ]:
        env = dict(re.findall(r"\b([A-Z_]+)=(\S+)", cmd[: cmd.index("ray start")]))
        # HF_HOME is on /fsx, where the hub client would look for its token: point it at the node's file.
        assert env["HF_TOKEN_PATH"].replace("$HOME", "~") == remote
        assert "HF_TOKEN" not in env
    text = CLUSTER_YAML.read_text()
    assert not re.search(r"\bHF_TOKEN=", text), "no token value in the cluster config"

    # The hub client reads a token from that file by itself (the path HF_TOKEN_PATH names).
    import huggingface_hub
    from huggingface_hub import constants

    token_file = tmp_path / "token"
    token_file.write_text("hf_test_token\n")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(token_file))
    assert huggingface_hub.get_token() == "hf_test_token"


def test_the_readme_submits_without_the_hf_token_in_the_runtime_env():
    readme = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    for m in re.finditer(r"--runtime-env-json\s+'([^']*)'", readme):
        assert "HF_TOKEN" not in m.group(1), f"a token in the job table: {m.group(0)}"
    cluster_doc = (ROOT / "docs/cluster.md").read_text()
    aws = cluster_doc[cluster_doc.index("## Run on AWS") :]
    assert "~/.cache/huggingface/token" in aws[: aws.index("\n## ", 5)]
    for config in ROOT.glob("configs/*-c7i.yaml"):
        assert "in the job's environment" not in config.read_text(), config.name


def test_the_spot_watcher_logs_where_ray_logs_finds_it(cluster):
    worker = next(c for c in cluster["worker_start_ray_commands"] if "ray start" in c)
    assert "--log=/tmp/ray/session_latest/logs/raytrain-spot-watch.log" in worker
    assert "--give-up-s" not in worker, "a watcher that gives up leaves its node unwatched"


# ----------------------------------------------------------------------------- EKS: spot notices, capacity, IMDSv2


def test_eks_spot_pods_run_the_spot_watcher_and_the_rest_are_on_demand(eks_docs):
    rc = _kinds(eks_docs)["RayCluster"][0]
    groups = {g["groupName"]: g["template"]["spec"] for g in rc["spec"]["workerGroupSpecs"]}
    groups["head"] = rc["spec"]["headGroupSpec"]["template"]["spec"]
    spot = {k for k, pod in groups.items() if pod["nodeSelector"].get("karpenter.sh/capacity-type") == "spot"}
    assert spot == {"c7i-48xl-spot"}
    for name, pod in groups.items():
        if name not in spot:  # the NodePool offers spot too: without this Karpenter may choose it
            assert pod["nodeSelector"].get("karpenter.sh/capacity-type") == "on-demand", name
    volumes = {v["name"]: v for v in groups["c7i-48xl-spot"]["volumes"]}
    ray, watcher = groups["c7i-48xl-spot"]["containers"]
    command = " ".join(watcher["command"])
    head_svc = f"{rc['metadata']['name']}-head-svc:6379"  # KubeRay's head service
    assert f"python -m raytrain_cpu.spot --address={head_svc}" in command
    assert "--log=/tmp/ray/session_latest/logs/raytrain-spot-watch.log" in command
    assert watcher["image"] == ray["image"]
    env = {e["name"]: e for e in watcher["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": rc["spec"]["authOptions"]["secretName"],
        "key": "auth_token",
    }
    # Ray's log directory is one volume in both containers, so `ray logs` finds the watcher's log.
    logs = {m["name"] for c in (ray, watcher) for m in c["volumeMounts"] if m["mountPath"] == "/tmp/ray"}
    assert len(logs) == 1 and "emptyDir" in volumes[logs.pop()]
    for name, pod in groups.items():
        if name not in spot:
            assert [c["name"] for c in pod["containers"]] != [c["name"] for c in (ray, watcher)], name


def test_eks_nodes_require_imdsv2_with_two_hops(eks_docs):
    (node_class,) = _kinds(eks_docs)["EC2NodeClass"]
    assert node_class["spec"]["metadataOptions"] == {
        "httpEndpoint": "enabled",
        "httpProtocolIPv6": "disabled",
        "httpTokens": "required",
        "httpPutResponseHopLimit": 2,  # pods are one hop further than the node (Karpenter's default: 1)
    }


def test_eks_hf_token_comes_from_a_secret_not_the_job(eks_docs):
    for pod in _pod_specs(_kinds(eks_docs)["RayCluster"][0]):
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        ref = env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "raytrain-hf-token", "key": "token", "optional": True}
