"""docker/k8s: the kustomizations render (`kubectl kustomize`, Debian's kubernetes-client, which `make k8s-deps`
unpacks into .venv/k8s) and every object validates against the Kubernetes OpenAPI schemas of v1.25 and v1.37
(kubernetes-validate, strict: unknown fields are errors). Then what a schema cannot see: the pieces of a ps-lite job
agree with each other (counts, names, ports, selectors), and each server pod's environment, as the kubelet would
expand it, is one kvstore_lazy's own Config accepts with the intended bind, advertised name and recovery.

The MXJob and JobSet examples are custom resources: their fields are checked against the API types they were
written against (training-operator v1.8.1 MXJob, JobSet v0.10.1; the field lists below are read from those types),
and every pod or Job template inside them against the core schemas.
"""
from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="make k8s-deps installs it")

from kvstore_lazy.node import placement as lifecycle  # noqa: E402
from kvstore_lazy.node.runtime import Config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "docker" / "k8s"
KUSTOMIZATIONS = ["base", "overlays/dev", "overlays/large"]
VERSIONS = ["1.25", "1.37"]          # the oldest and newest schemas kubernetes-validate 1.37 ships
IMAGE = re.compile(r"^([a-z0-9.-]+(:[0-9]+)?/)*kvstore-lazy:[\w.-]+$")
KUBECTL = Path(os.environ.get("KVSTORE_LAZY_KUBECTL") or ROOT / ".venv" / "k8s" / "usr" / "bin" / "kubectl")


def kubectl() -> str:
    if not KUBECTL.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{KUBECTL} is missing: `make k8s-deps` installs it")
        pytest.skip(f"{KUBECTL} is missing: run `make k8s-deps`")
    return str(KUBECTL)


def render(path: str, binary: str | None = None) -> list[dict]:
    out = subprocess.run([binary or kubectl(), "kustomize", str(K8S / path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {path}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def validate(obj: dict) -> None:
    for version in VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            raise AssertionError(f"{obj['kind']}/{obj['metadata'].get('name')} against Kubernetes {version}: "
                                 f"{where}: {exc.message}") from None


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, [o["metadata"]["name"] for o in objects if o["kind"] == kind])
    return found[0]


def container(pod_spec: dict, name: str | None = None) -> dict:
    found = [c for c in pod_spec["containers"] if name is None or c["name"] == name]
    assert len(found) == 1, (name, [c["name"] for c in pod_spec["containers"]])
    return found[0]


def pod_env(c: dict, pod: dict, configmaps: dict[str, dict] | None = None, appended: dict | None = None) -> dict:
    """The environment the kubelet gives container `c` of `pod` (metadata: name, labels, annotations; status:
    podIP): envFrom ConfigMaps, then env in order, with fieldRef values and $(VAR) references to variables defined
    before (an undefined reference stays as written, as the kubelet leaves it); `appended`: variables an operator
    adds after the template's own."""
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]])
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), var["value"])
        else:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
            if match:
                env[var["name"]] = pod["metadata"][match.group(1)][match.group(2)]
            else:
                section, field = path.split(".")
                env[var["name"]] = pod[section][field]
    env.update(appended or {})
    unresolved = {k: v for k, v in env.items() if "$(" in v}
    assert not unresolved, f"references to variables not defined before them: {unresolved}"
    return env


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def server_config(env: dict) -> Config:
    config = Config.from_env(env)
    assert config.bind == lifecycle.ALL_INTERFACES
    assert config.recovery == "auto" and config.resend and config.journal and config.snapshot_dir
    assert config.port > 0
    return config


# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def rendered(request):
    return request.param, render(request.param)


def test_every_object_validates_against_the_kubernetes_schemas(rendered):
    path, objects = rendered
    assert sorted(o["kind"] for o in objects) == ["ConfigMap", "ConfigMap", "Deployment", "Job",
                                                  "PersistentVolumeClaim", "Service", "Service", "StatefulSet"], path
    for obj in objects:
        validate(obj)


def test_the_validation_is_strict_and_catches_mistakes():
    """A misspelt field, a wrong type and a missing required field each fail (so the test above can fail)."""
    objects = render("base")
    sts = one(objects, "StatefulSet")
    validate(sts)
    for breaks in (lambda o: o["spec"].update(replica=2),
                   lambda o: o["spec"].update(replicas="2"),
                   lambda o: o["spec"]["template"]["spec"]["containers"][0].pop("name")):
        broken = copy.deepcopy(sts)
        breaks(broken)
        with pytest.raises(AssertionError, match="against Kubernetes"):
            validate(broken)


def check_job_wiring(objects: list[dict]) -> dict:
    """What must agree for the ps-lite job to form; returns the pieces for further checks."""
    configmaps = {o["metadata"]["name"]: o["data"] for o in objects if o["kind"] == "ConfigMap"}
    common = configmaps["kvl-env"]
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    scheduler = one(objects, "Deployment", "kvl-scheduler")
    servers = one(objects, "StatefulSet", "kvl-server")
    workers = one(objects, "Job", "kvl-workers")
    # counts
    assert int(common["DMLC_NUM_SERVER"]) == servers["spec"]["replicas"], "DMLC_NUM_SERVER != server replicas"
    assert int(common["DMLC_NUM_WORKER"]) == workers["spec"]["completions"] == workers["spec"]["parallelism"], \
        "DMLC_NUM_WORKER != worker completions/parallelism"
    assert scheduler["spec"]["replicas"] == 1
    # the scheduler: reached by its headless Service's name, on its container port, binding 0.0.0.0
    sched_svc = services[common["DMLC_PS_ROOT_URI"]]
    sched_pod = scheduler["spec"]["template"]
    sched_c = container(sched_pod["spec"])
    assert sched_svc["spec"]["clusterIP"] == "None" and sched_svc["spec"]["publishNotReadyAddresses"] is True
    assert selects(sched_svc["spec"]["selector"], sched_pod["metadata"]["labels"])
    assert not selects(sched_svc["spec"]["selector"], servers["spec"]["template"]["metadata"]["labels"])
    root_port = int(common["DMLC_PS_ROOT_PORT"])
    assert [p["containerPort"] for p in sched_c["ports"]] == [root_port] == \
        [p["port"] for p in sched_svc["spec"]["ports"]]
    assert common["DMLC_USE_KUBERNETES"] == "1" and common["PS_RESEND"] == "1"
    # the servers: a governing headless Service that publishes not-Ready pods, started in parallel
    srv_svc = services[servers["spec"]["serviceName"]]
    srv_pod = servers["spec"]["template"]
    assert srv_svc["spec"]["clusterIP"] == "None" and srv_svc["spec"]["publishNotReadyAddresses"] is True
    assert selects(srv_svc["spec"]["selector"], srv_pod["metadata"]["labels"])
    assert selects(servers["spec"]["selector"]["matchLabels"], srv_pod["metadata"]["labels"])
    assert servers["spec"]["podManagementPolicy"] == "Parallel"   # Ready needs every node registered
    srv_c = container(srv_pod["spec"])
    assert srv_c["readinessProbe"]["exec"]["command"] == ["python", "-m", "kvstore_lazy.server", "--ready"]
    mounts = {m["name"]: m["mountPath"] for m in srv_c["volumeMounts"]}
    assert [t["metadata"]["name"] for t in servers["spec"]["volumeClaimTemplates"]] == list(mounts)
    for template in servers["spec"]["volumeClaimTemplates"]:   # `kubectl delete pvc -l ...` (README) finds them
        assert template["metadata"]["labels"]["app.kubernetes.io/name"] == "kvstore-lazy"
    # the workers: an Indexed Job that does not retry (a stock worker cannot rejoin)
    assert workers["spec"]["completionMode"] == "Indexed" and workers["spec"]["backoffLimit"] == 0
    wrk_pod = workers["spec"]["template"]
    assert wrk_pod["spec"]["restartPolicy"] == "Never"
    claims = {v["persistentVolumeClaim"]["claimName"] for v in wrk_pod["spec"]["volumes"]
              if "persistentVolumeClaim" in v}
    assert claims <= {o["metadata"]["name"] for o in objects if o["kind"] == "PersistentVolumeClaim"}
    wrk_c = container(wrk_pod["spec"])
    assert (ROOT / wrk_c["command"][1]).exists() and wrk_c["workingDir"] == "/app"   # the image's /app is the repo
    # every container: the project's image, resource requests, the common environment
    for c in (sched_c, srv_c, wrk_c):
        assert IMAGE.match(c["image"]), c["image"]
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
        assert {"configMapRef": {"name": "kvl-env"}} in c["envFrom"], c["name"]
    return dict(configmaps=configmaps, servers=servers, srv_c=srv_c, srv_svc=srv_svc, sched_c=sched_c,
                sched_pod=sched_pod, wrk_c=wrk_c, wrk_pod=wrk_pod, root_port=root_port)


def test_the_job_fits_together(rendered):
    check_job_wiring(rendered[1])


def test_a_mismatch_is_caught():
    objects = render("base")
    one(objects, "ConfigMap", "kvl-env")["data"]["DMLC_NUM_SERVER"] = "3"
    with pytest.raises(AssertionError, match="DMLC_NUM_SERVER"):
        check_job_wiring(objects)
    objects = render("base")
    one(objects, "StatefulSet")["spec"]["podManagementPolicy"] = "OrderedReady"
    with pytest.raises(AssertionError):
        check_job_wiring(objects)


def test_each_pod_environment_is_what_the_nodes_expect(rendered):
    """Expanded as the kubelet does, for every server ordinal: kvstore_lazy's Config takes it, binds 0.0.0.0 on the
    Service's port and advertises <pod>.<service>, the name every ordinal keeps across re-creation."""
    w = check_job_wiring(rendered[1])
    ports = [p["port"] for p in w["srv_svc"]["spec"]["ports"]]
    names = set()
    for ordinal in range(w["servers"]["spec"]["replicas"]):
        pod = {"metadata": {"name": f"kvl-server-{ordinal}", "labels": {}, "annotations": {}},
               "status": {"podIP": f"10.1.0.{ordinal + 10}"}}
        env = pod_env(w["srv_c"], pod, w["configmaps"])
        config = server_config(env)
        assert config.host == f"kvl-server-{ordinal}.{w['srv_svc']['metadata']['name']}"
        assert [config.port] == ports == [p["containerPort"] for p in w["srv_c"]["ports"]]
        assert config.num_servers == w["servers"]["spec"]["replicas"]
        assert config.root_uri == "kvl-scheduler" and config.root_port == w["root_port"]
        assert config.snapshot_dir == {m["name"]: m["mountPath"] for m in w["srv_c"]["volumeMounts"]}["snapshots"]
        assert lifecycle.STATUS_ENV in env and config.snapshot_scope == "server"   # a volume of its own
        names.add(config.host)
    assert len(names) == w["servers"]["spec"]["replicas"]
    sched = pod_env(w["sched_c"], {"metadata": {}, "status": {}}, w["configmaps"])
    assert sched["DMLC_ROLE"] == "scheduler" and sched["DMLC_USE_KUBERNETES"] == "1"
    worker = pod_env(w["wrk_c"], {"metadata": {}, "status": {"podIP": "10.1.0.99"}}, w["configmaps"])
    assert worker["DMLC_ROLE"] == "worker" and worker["DMLC_NODE_HOST"] == "10.1.0.99"


def test_other_renderers_give_the_same_objects():
    """The kustomizations use only what kustomize v2.0.3 (Debian's kubectl 1.20) knows; a newer kubectl on PATH
    (kustomize v4/v5: deprecated fields still work) must render the same objects."""
    other = shutil.which("kubectl")
    if other is None or Path(other).resolve() == KUBECTL.resolve():
        pytest.skip("no other kubectl on PATH to compare with")
    version = subprocess.run([other, "version", "--client"], capture_output=True, text=True, timeout=30).stdout
    for path in KUSTOMIZATIONS:
        ours = sorted(map(repr, render(path)))
        theirs = sorted(map(repr, render(path, other)))
        assert ours == theirs, f"{path}: {other} ({version.strip()}) renders other objects"


# ----------------------------------------------------------------------------------------------------------------
# custom resources: fields of the API types they were written against

# training-operator v1.8.1, pkg/apis/kubeflow.org/v1: MXJobSpec, ReplicaSpec, RunPolicy, SchedulingPolicy
MXJOB_SPEC = {"runPolicy", "jobMode", "mxReplicaSpecs"}
MX_REPLICA_TYPES = {"Scheduler", "Server", "Worker", "TunerTracker", "TunerServer", "Tuner"}
REPLICA_SPEC = {"replicas", "template", "restartPolicy"}
RUN_POLICY = {"cleanPodPolicy", "ttlSecondsAfterFinished", "activeDeadlineSeconds", "backoffLimit",
              "schedulingPolicy", "suspend"}
RESTART_POLICIES = {"Always", "OnFailure", "Never", "ExitCode"}
CLEAN_POD_POLICIES = {"All", "Running", "None"}
# JobSet v0.10.1, api/jobset/v1alpha2/jobset_types.go
JOBSET_SPEC = {"replicatedJobs", "network", "successPolicy", "failurePolicy", "startupPolicy", "suspend",
               "coordinator", "managedBy", "ttlSecondsAfterFinished"}
REPLICATED_JOB = {"name", "groupName", "template", "replicas", "dependsOn"}
NETWORK = {"enableDNSHostnames", "subdomain", "publishNotReadyAddresses"}
SUCCESS_POLICY = {"operator", "targetReplicatedJobs"}
FAILURE_POLICY = {"maxRestarts", "restartStrategy", "rules"}
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def example(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / "examples" / name).read_text()) if d]


def keys_within(obj: dict, allowed: set, what: str) -> None:
    assert set(obj) <= allowed, f"{what}: unknown fields {sorted(set(obj) - allowed)}"


def custom_resource(file: str, kind: str, api_version: str) -> tuple[list[dict], dict]:
    """The objects of an example (the core ones validated) and its one custom resource."""
    objects = example(file)
    for obj in objects:
        if obj["kind"] != kind:
            validate(obj)
    resource = one(objects, kind)
    assert resource["apiVersion"] == api_version
    return objects, resource


def validate_pod_template(template: dict, name: str) -> None:
    validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template})


def test_mxjob_example_follows_the_v1_8_1_types_and_its_pods_validate():
    objects, job = custom_resource("mxjob.yaml", "MXJob", "kubeflow.org/v1")
    name = job["metadata"]["name"]
    assert DNS1035.match(name) and len(name) <= 63          # ValidateV1MXJob: a DNS-1035 label
    spec = job["spec"]
    keys_within(spec, MXJOB_SPEC, "MXJob spec")
    assert {"jobMode", "mxReplicaSpecs"} <= set(spec) and spec["jobMode"] == "MXTrain"   # required (CRD)
    keys_within(spec["runPolicy"], RUN_POLICY, "runPolicy")
    assert spec["runPolicy"].get("cleanPodPolicy", "None") in CLEAN_POD_POLICIES
    replicas = spec["mxReplicaSpecs"]
    assert set(replicas) == {"Scheduler", "Server", "Worker"} <= MX_REPLICA_TYPES
    assert replicas["Scheduler"]["replicas"] == 1
    claims = {o["metadata"]["name"] for o in objects if o["kind"] == "PersistentVolumeClaim"}
    for rtype, rspec in replicas.items():
        keys_within(rspec, REPLICA_SPEC, f"mxReplicaSpecs.{rtype}")
        assert rspec["restartPolicy"] in RESTART_POLICIES
        validate_pod_template(rspec["template"], f"{name}-{rtype.lower()}")
        mx = container(rspec["template"]["spec"], "mxnet")          # the operator's container name
        assert mx["image"] and IMAGE.match(mx["image"])
        assert "mxjob-port" in [p.get("name") for p in mx["ports"]]  # getPortFromMXJob, for every replica type
        for volume in rspec["template"]["spec"].get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
    # the servers' environment after the operator appended its variables (mxnet.go SetPodEnv, v1.8.1)
    ports = {r: next(p["containerPort"] for p in container(s["template"]["spec"], "mxnet")["ports"]
                     if p["name"] == "mxjob-port") for r, s in replicas.items()}
    server = container(replicas["Server"]["template"]["spec"], "mxnet")
    for index in range(replicas["Server"]["replicas"]):
        pod = {"metadata": {"labels": {"training.kubeflow.org/job-name": name,
                                       "training.kubeflow.org/replica-index": str(index),
                                       "training.kubeflow.org/replica-type": "server"}}}
        injected = {"DMLC_PS_ROOT_PORT": str(ports["Scheduler"]), "DMLC_PS_ROOT_URI": f"{name}-scheduler-0",
                    "DMLC_NUM_SERVER": str(replicas["Server"]["replicas"]),
                    "DMLC_NUM_WORKER": str(replicas["Worker"]["replicas"]), "DMLC_ROLE": "server",
                    "DMLC_USE_KUBERNETES": "1"}
        config = server_config(pod_env(server, pod, appended=injected))
        assert config.host == f"{name}-server-{index}"              # the operator's Service for this replica
        assert config.port == ports["Server"]
    assert replicas["Server"]["restartPolicy"] == "ExitCode"       # re-created pods rejoin by name
    assert "readinessProbe" not in server      # the operator's Services publish Ready pods only (see the file)


def test_jobset_example_follows_the_v0_10_1_types_and_its_jobs_validate():
    objects, js = custom_resource("jobset.yaml", "JobSet", "jobset.x-k8s.io/v1alpha2")
    name = js["metadata"]["name"]
    spec = js["spec"]
    keys_within(spec, JOBSET_SPEC, "JobSet spec")
    keys_within(spec["network"], NETWORK, "network")
    keys_within(spec["successPolicy"], SUCCESS_POLICY, "successPolicy")
    keys_within(spec["failurePolicy"], FAILURE_POLICY, "failurePolicy")
    subdomain = spec["network"].get("subdomain", name)
    assert DNS1035.match(subdomain)
    assert spec["network"].get("publishNotReadyAddresses", True) is True   # names resolve before Ready
    rjobs = {r["name"]: r for r in spec["replicatedJobs"]}
    assert set(spec["successPolicy"]["targetReplicatedJobs"]) <= set(rjobs)
    assert spec["successPolicy"]["operator"] in ("All", "Any")
    env_of = {}
    for rname, rjob in rjobs.items():
        keys_within(rjob, REPLICATED_JOB, f"replicatedJobs.{rname}")
        assert {"name", "template"} <= set(rjob)
        validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{name}-{rname}-0"},
                  "spec": rjob["template"]["spec"]})
        job_spec = rjob["template"]["spec"]
        for j in range(rjob.get("replicas", 1)):
            for p in range(job_spec.get("completions", 1)):
                assert DNS1035.match(f"{name}-{rname}-{j}-{p}-abcde")       # the webhook's pod name check
        env_of[rname] = (container(job_spec["template"]["spec"]), job_spec)
    sched_host = f"{name}-scheduler-0-0.{subdomain}"
    servers_c, servers_job = env_of["server"]
    workers_c, workers_job = env_of["workers"]
    for rname, (c, job_spec) in env_of.items():
        env = pod_env(c, {"metadata": {"annotations": {"batch.kubernetes.io/job-completion-index": "0"}},
                          "status": {"podIP": "10.2.0.5"}})
        assert env["DMLC_PS_ROOT_URI"] == sched_host, rname
        assert int(env["DMLC_NUM_SERVER"]) == servers_job["completions"] == servers_job["parallelism"]
        assert int(env["DMLC_NUM_WORKER"]) == workers_job["completions"] == workers_job["parallelism"]
        assert env["PS_RESEND"] == "1" and IMAGE.match(c["image"])
    sched_env = pod_env(env_of["scheduler"][0], {"metadata": {}, "status": {}})
    assert sched_env["DMLC_USE_KUBERNETES"] == "1" and sched_env["DMLC_ROLE"] == "scheduler"
    for index in range(servers_job["completions"]):
        pod = {"metadata": {"annotations": {"batch.kubernetes.io/job-completion-index": str(index)}}}
        config = server_config(pod_env(servers_c, pod))
        assert config.host == f"{name}-server-0-{index}.{subdomain}"   # the pod's JobSet hostname
