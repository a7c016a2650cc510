"""Every example runs (at small size), so none can rot."""

from __future__ import annotations

import pathlib
from types import ModuleType

import pytest
from helpers import load_script

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def load(name: str) -> ModuleType:
    return load_script("examples", name)


def test_every_example_is_tested() -> None:
    assert {p.stem for p in EXAMPLES.glob("*.py")} == {
        "quickstart",
        "gpt_policies",
        "sequential_save_last",
        "per_example_grads",
        "flow_divergence",
        "hf_trainer",
        "accelerate_prewrap",
        "compare_policies",
    }


def test_quickstart() -> None:
    losses = load("quickstart").main(small=True)
    assert len(set(losses.values())) == 1


def test_gpt_policies() -> None:
    kept = load("gpt_policies").main(small=True)
    assert kept["nothing-saveable"] == 0
    assert 0 < kept["dots-no-batch-saveable"] < kept["dots-saveable"] < kept["everything-saveable"]


def test_sequential_save_last() -> None:
    counts = load("sequential_save_last").main(small=True)
    assert counts == [1, 1, 1, 1, 1, 1, 0, 0]


def test_per_example_grads() -> None:
    result = load("per_example_grads").main(small=True)
    assert result["peak"]["nothing-saveable"] < result["peak"]["none"]
    assert all(d <= 1e-5 for d in result["max_abs_diff"].values())
    assert "saved tensor hooks" in result["torch_checkpoint_error"]


def test_flow_divergence() -> None:
    result = load("flow_divergence").main(small=True)
    assert result["peak"]["nothing-saveable"] < result["peak"]["none"]
    assert all(d <= 1e-5 for d in result["max_abs_diff"].values())
    assert "saved tensor hooks" in result["torch_checkpoint_error"]


def test_hf_trainer() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # the Trainer needs it
    result = load("hf_trainer").main(small=True)
    assert result["remat"]["checkpointed"] == ["transformer.h.0", "transformer.h.1"]
    assert result["plain"]["checkpointed"] == []
    assert len(result["remat"]["losses"]) == 2
    assert result["remat"]["losses"] == result["plain"]["losses"]


def test_accelerate_prewrap() -> None:
    pytest.importorskip("accelerate")
    result = load("accelerate_prewrap").main(small=True)
    assert [run["wrapped"] for run in result.values()] == [0, 3, 3]
    assert result["remat.apply"]["losses"] == pytest.approx(result["plain"]["losses"])
    assert result["checkpoint_wrapper"]["losses"] == pytest.approx(result["plain"]["losses"])


def test_compare_policies(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("matplotlib")
    peaks = load("compare_policies").main(small=True, figure=tmp_path / "compare.png")
    assert (tmp_path / "compare.png").stat().st_size > 0
    assert peaks["nothing-saveable"] < peaks["dots-saveable"] < peaks["none"]
    assert peaks["everything-saveable"] == peaks["none"]


def test_the_docs_show_the_compare_plot() -> None:
    page = (EXAMPLES.parent / "docs" / "inspection.md").read_text()
    assert "![" in page and "images/compare.png" in page
    assert (EXAMPLES.parent / "docs" / "images" / "compare.png").exists()


@pytest.mark.parametrize(
    "name",
    [
        "quickstart", "gpt_policies", "sequential_save_last", "per_example_grads",
        "flow_divergence", "hf_trainer", "accelerate_prewrap", "compare_policies",
    ],
)
def test_examples_have_a_main_with_small(name: str) -> None:
    import inspect

    assert "small" in inspect.signature(load(name).main).parameters
