"""Every input is checked before Ray starts: plug-ins, worker classes, model, data, typos.

The CLI cases run the real command in-process (:func:`tests.harness.check_cli`), which fails
if the launcher is ever reached; the data-file cases call the checks directly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlframe.config import ActorConfig, Config, ConfigError, DataConfig, ModelConfig, RolloutConfig
from rlframe.data.tiny_model import build_tiny_tokenizer
from rlframe.run.preflight import check_plugins, load_model_files, load_training_prompts
from tests.unit.cli_errors import check_config_error

PLUGINS = Path(__file__).resolve().parents[1] / "plugins" / "my_algorithms.py"


@pytest.mark.parametrize(
    "override,message",
    [
        ("reward.fn=no_such_file.py:score", "reward.fn: no_such_file.py:score': no file"),
        (f"reward.fn={PLUGINS}:missing", "reward.fn: has no function 'missing'"),
        (
            "algorithm.policy_loss=no_such_pkg.losses:mine",
            "algorithm.policy_loss: cannot be loaded: ModuleNotFoundError",
        ),
        (
            "algorithm.advantage=gea",
            "algorithm.advantage: unknown advantage 'gea'; registered: ['gae', 'grpo', "
            "'grpo_passk'",
        ),
        (
            "actor.worker_cls=workers.hybrid.NoSuchWorker",
            "actor.worker_cls: cannot be loaded: ImportError: 'workers.hybrid.NoSuchWorker' "
            "cannot be imported",
        ),
        ("model.path=/no/such/model", "model.path: no such folder /no/such/model"),
        (
            "data.train_files=[/no/such/file.jsonl]",
            "data.train_files: /no/such/file.jsonl: no such file",
        ),
        ("data.task=arithmatic", "data.task: must be one of ['arithmetic'"),
        ("+trainer.foo=1", "trainer.foo: unknown key; keys allowed in trainer:"),
        ("+trainer.total_step=5", "trainer.total_step: unknown key"),
        (
            "+trainer.total_steps=5",
            "trainer.total_steps: set schema keys as trainer.total_steps=VALUE, without '+'",
        ),
        ("rollout.n=1", "rollout.n: algorithm.advantage=grpo compares the responses to one prompt"),
    ],
)
def test_bad_inputs_fail_before_ray_with_one_line(override: str, message: str) -> None:
    key, text = message.split(": ", 1)
    check_config_error("+recipe=grpo_tiny", override, key=key, text=text)


def make_config(files: list[str], batch_size: int = 2, max_prompt_length: int = 16) -> Config:
    return Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(
            train_files=files, batch_size=batch_size, max_prompt_length=max_prompt_length
        ),
        rollout=RolloutConfig(n=2),
        actor=ActorConfig(mini_batch_size=2 * batch_size, micro_batch_size=2),
    )


def write_bad_files(folder: Path) -> dict[str, Path]:
    files = {
        "empty": folder / "empty.jsonl",
        "corrupt": folder / "corrupt.parquet",
        "broken_line": folder / "broken.jsonl",
        "no_truth": folder / "no_truth.jsonl",
        "no_prompt": folder / "no_prompt.jsonl",
        "csv": folder / "rows.csv",
    }
    files["empty"].write_text("")
    files["corrupt"].write_bytes(b"PAR1 this is not a parquet file")
    files["broken_line"].write_text(
        json.dumps({"prompt": "1+1=", "ground_truth": "2"}) + "\n{not json\n"
    )
    files["no_truth"].write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    files["no_prompt"].write_text(json.dumps({"question": "1+1=", "ground_truth": "2"}) + "\n")
    files["csv"].write_text("prompt,ground_truth\n1+1=,2\n")
    return files


@pytest.mark.parametrize(
    "name,message",
    [
        ("empty", "empty.jsonl: the file holds no rows"),
        ("corrupt", "corrupt.parquet: cannot be read as parquet"),
        ("broken_line", "broken.jsonl: cannot be read as jsonl: line 2"),
        (
            "no_truth",
            "no_truth.jsonl row 0: a row needs a 'ground_truth' column; it has ['answer', "
            "'prompt']",
        ),
        (
            "no_prompt",
            "no_prompt.jsonl row 0: a row needs a 'prompt' or 'messages' column; it has "
            "['ground_truth', 'question']",
        ),
        ("csv", "rows.csv: prompt files must be .parquet, .jsonl or .json"),
    ],
)
def test_bad_data_files_are_named(tmp_path: Path, name: str, message: str) -> None:
    path = write_bad_files(tmp_path)[name]
    with pytest.raises(ConfigError) as error:
        load_training_prompts(make_config([str(path)]), build_tiny_tokenizer())
    assert error.value.key == "data.train_files"
    assert message in str(error.value)


def test_too_few_prompts_and_dropped_ones_are_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "few.parquet"
    pq.write_table(
        pa.table({"prompt": ["1+1=", "2+2=", "9" * 40], "ground_truth": ["2", "4", "9"]}), path
    )
    records = load_training_prompts(make_config([str(path)], batch_size=2), build_tiny_tokenizer())
    assert [r.prompt for r in records] == ["1+1=", "2+2="]
    assert (
        "1 of 3 prompts dropped: longer than data.max_prompt_length=16 tokens"
        in capsys.readouterr().err
    )
    with pytest.raises(
        ConfigError, match=r"data.batch_size: 4 exceeds the 2 prompts available \(3 rows, 1 longer"
    ):
        load_training_prompts(make_config([str(path)], batch_size=4), build_tiny_tokenizer())


def test_model_folder_without_config_and_plugins_that_load(tmp_path: Path) -> None:
    cfg = make_config([])
    cfg.model.path = str(tmp_path)
    with pytest.raises(ConfigError, match="model.path: .* holds no config.json"):
        load_model_files(cfg)
    cfg.algorithm.advantage = f"{PLUGINS}:compute_sign_advantages"
    cfg.algorithm.policy_loss = "tests.plugins.my_algorithms:compute_reinforce_loss"
    check_plugins(cfg)  # both load: no error
