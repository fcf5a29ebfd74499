"""The CLI is thin: `hybridpar plan ... --json` and `hybridpar.plan(...)` go through one workflow
(hybridpar.api.plan), so for a file model they predict the same thing, the dry run's re-pricing of
what DTensor redistributes between our layers included."""

import json

import hybridpar
from hybridpar.cli.commands.plan import _result_json
from hybridpar.cli.main import main

MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = torch.softmax(self.c1(x), dim=1)  # mixes channels between our layers: DTensor gathers them
        return self.fc(self.c2(x).mean((2, 3)))


def factory():
    return Net()
'''


def _comparable(d: dict) -> dict:
    d = dict(d)
    d.pop("solve_s")  # wall time of the search
    return json.loads(json.dumps(d))


def test_cli_plan_json_equals_python_plan_for_a_file_model(tmp_path, capsys):
    path = tmp_path / "net.py"
    path.write_text(MODEL)
    spec = f"{path}:factory"
    args = ["plan", "--model", spec, "--cluster", "localhost", "--gpus", "2", "--batch", "4",
            "--strategy", "channel=2", "--input-shape", "3,8,8", "--json"]
    assert main(args) == 0
    from_cli = json.loads(capsys.readouterr().out)
    res = hybridpar.plan(spec, "localhost", 2, 4, strategy="channel=2", input_shape=(3, 8, 8))
    from_api = _result_json(res)
    assert _comparable(from_cli) == _comparable(from_api)
    # the dry run's re-pricing is in both (a file model gets it by default) ...
    assert any(n.startswith("dry run: DTensor redistributes") for n in from_api["plan"]["notes"])
    # ... and it changes the prediction: without it the step is cheaper
    bare = hybridpar.plan(spec, "localhost", 2, 4, strategy="channel=2", input_shape=(3, 8, 8), dry_run=False)
    assert bare.prediction.step_time_s < res.prediction.step_time_s
