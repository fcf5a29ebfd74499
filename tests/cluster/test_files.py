import json

import pytest
import yaml

from hybridpar.cli.main import main
from hybridpar.cluster import load_cluster
from hybridpar.cluster.loader import PRESET_DIR
from hybridpar.errors import UserError


def _preset(name="dgx1-v100"):
    return yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text())


def _write(tmp_path, data, name="c.yaml"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def test_user_file_with_plain_numbers_loads(tmp_path):
    data = {"name": "mine", "gpus_per_node": 2,
            "device": {"name": "gpu", "peak_flops": {"fp32": 1e13}, "mem_bw_Bps": 1e12, "memory_bytes": 1e10},
            "intra": {"kind": "switch", "link_name": "x", "link_bw_Bps": 1e10, "link_latency_s": 1e-6,
                      "links_per_device": 2},
            "inter": {"name": "net", "nics_per_node": 1, "nic_bw_Bps": 1e9, "latency_s": 1e-5}}
    c = load_cluster(str(_write(tmp_path, data)), gpus=5)
    assert (c.num_nodes, c.num_devices) == (3, 5)
    assert c.p2p_bw_Bps(0, 1) == 2e10 and c.p2p_bw_Bps(0, 2) == 1e9
    # JSON works too.
    c2 = load_cluster(str(_write(tmp_path, json.dumps(data), "c.json")))
    assert c2.num_devices == 2


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["device"].pop("mem_bw_Bps"), "device.mem_bw_Bps"),
    (lambda d: d["intra"]["links"].append({"a": 0, "b": 9, "count": 1}), "intra.links"),
    (lambda d: d["device"]["peak_flops"].update(fp32={"value": -1, "source": "x"}), "device.peak_flops.fp32"),
    (lambda d: d.update(gpus_per_node="eight"), "gpus_per_node"),
    (lambda d: d["inter"].update(nic_bw_Bps=float("inf")), "inter.nic_bw_Bps"),
    (lambda d: d.update(colour="green"), "colour"),
])
def test_malformed_file_names_the_field(tmp_path, mutate, field):
    data = _preset()
    mutate(data)
    with pytest.raises(UserError) as err:
        load_cluster(str(_write(tmp_path, data)))
    msg = str(err.value)
    assert "\n" not in msg and field in msg


def test_not_yaml_and_not_a_mapping(tmp_path):
    with pytest.raises(UserError, match="not valid YAML"):
        load_cluster(str(_write(tmp_path, "a: [1, 2\n")))
    with pytest.raises(UserError, match="expected a mapping"):
        load_cluster(str(_write(tmp_path, "- 1\n- 2\n")))


@pytest.mark.parametrize("argv_tail, needle", [
    (["--show", "no-such-cluster"], "unknown cluster"),
    (["--show", "dgx1-v100", "--gpus", "-2"], "gpus must be >= 1"),
])
def test_cli_bad_input_is_one_line_exit_2(capsys, argv_tail, needle):
    assert main(["clusters", *argv_tail]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err


def test_cli_malformed_file_one_line_exit_2(tmp_path, capsys):
    data = _preset()
    data["intra"]["kind"] = "torus"
    path = _write(tmp_path, data)
    assert main(["clusters", "--show", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "intra.kind" in err


def test_cli_lists_and_shows(capsys):
    assert main(["clusters", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["dgx1-v100"]["devices_per_node"] == 8 and rows["dgx1-v100"]["peak_flops"]["fp16"] == 125e12
    assert rows["dgx1-v100"]["inter_bw_per_node_Bps"] == 4 * 12.5e9
    assert main(["clusters", "--show", "dgx1-v100", "--gpus", "16", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["num_nodes"] == 2 and d["link_matrix"][0][3] == "NV2" and d["link_matrix"][0][6] == "SYS"
    assert "rapidsai/ucx-py" in " ".join(d["sources"].values())
    assert main(["clusters", "--show", "dgx1-v100"]) == 0
    out = capsys.readouterr().out
    assert "NV2" in out and "SYS" in out and "sources" in out and "[approximation]" in out
