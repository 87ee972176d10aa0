"""On-policy distillation's pure parts against numbers worked by hand: the per-token
advantage, the k1 loss term, the teacher picked per prompt, the reading laid on the response
grid, and the config's refusals (before Ray, one line naming the key)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlframe.algorithms.losses import LossScale
from rlframe.algorithms.policy_objective import DistillTerm, PolicyTerms, compose_policy_loss
from rlframe.config import AlgorithmConfig, ConfigError
from rlframe.config.distill import DistillConfig
from rlframe.core.protocol import Batch
from rlframe.distill.objectives import add_distill_advantage
from rlframe.distill.teachers import pick_teacher, read_sequences
from rlframe.models.vocab import check_same_vocab
from tests.unit.cli_errors import check_config_error


def test_distill_advantage_is_the_weighted_task_advantage_minus_the_reverse_kl() -> None:
    """Student log-probs [-1, -2, -3, pad], teacher [-0.5, -4, -3, x], task advantage 1,
    task_weight 0.5, coef 2: 0.5 - 2 * [-0.5, 2, 0] = [1.5, -3.5, 0.5], 0 on the padding.
    A token the teacher likes more than the student gains; one it likes less loses."""
    student = torch.tensor([[-1.0, -2.0, -3.0, -9.0]])
    teacher = torch.tensor([[-0.5, -4.0, -3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    task = torch.ones(1, 4)
    out = add_distill_advantage(task, student, teacher, mask, coef=2.0, task_weight=0.5)
    torch.testing.assert_close(out, torch.tensor([[1.5, -3.5, 0.5, 0.0]]))
    pure = add_distill_advantage(task, student, teacher, mask, coef=1.0, task_weight=0.0)
    torch.testing.assert_close(pure, torch.tensor([[0.5, -2.0, 0.0, 0.0]]))


def test_k1_distill_term_adds_coef_times_the_mean_gap_and_its_gradient() -> None:
    """Zero advantages (no policy-gradient term); log pi - log pi_T = [0.3, -0.1, 0.4] on
    three loss tokens: k1 mean 0.2, times coef 0.5 = 0.1; the gradient 0.5 / 3 per token."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -7.0]], requires_grad=True)
    teacher = logprobs.detach() - torch.tensor([[0.3, -0.1, 0.4, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    terms = PolicyTerms(
        logprobs=logprobs,
        entropy=torch.zeros(1, 4),
        advantages=torch.zeros(1, 4),
        loss_mask=mask,
        scale=LossScale(tokens=3, sequences=1),
        old_logprobs=logprobs.detach(),
        teacher_logprobs=teacher,
    )
    out = compose_policy_loss(terms, AlgorithmConfig(), distill=DistillTerm(0.5, "k1"))
    assert out.loss.item() == pytest.approx(0.1, abs=1e-6)
    assert out.metrics["actor/distill_kl"] == pytest.approx(0.2, abs=1e-6)
    out.loss.backward()
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor([[1.0, 1.0, 1.0, 0.0]]) * 0.5 / 3)


def test_each_prompt_gets_the_teacher_its_column_names() -> None:
    several = DistillConfig(teachers={"math": "/m", "code": "/c"}, teacher_column="task")
    assert pick_teacher({"task": "code"}, several) == "teacher/code"
    assert pick_teacher({"task": "math", "other": 1}, several) == "teacher/math"
    with pytest.raises(KeyError, match="task='poetry'"):
        pick_teacher({"task": "poetry"}, several)
    assert pick_teacher({"task": "poetry"}, DistillConfig(teacher="/t")) == "teacher"


def test_a_rows_sequence_is_its_unpadded_prompt_and_whole_response() -> None:
    """Left-padded prompts, right-padded responses: the teacher scores ids[start:], which
    are exactly the response's tokens (position t of the grid reads response token t)."""
    batch = Batch(
        {
            "prompt_ids": torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]]),
            "prompt_mask": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
            "response_ids": torch.tensor([[11, 12, 0], [13, 0, 0]]),
            "response_mask": torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]),
        }
    )
    assert read_sequences(batch) == [([5, 6, 11, 12], 2), ([7, 8, 9, 10, 13], 4)]


@pytest.mark.parametrize(
    ("overrides", "key", "text"),
    [
        (
            ["distill.teacher=tiny:1", "+distill.teachers.a=tiny:2"],
            "distill.teachers",
            "not both",
        ),
        (["distill.teacher=tiny:1", "distill.coef=0"], "distill.coef", "> 0"),
        (["distill.teacher=tiny:1", "distill.task_weight=-1"], "distill.task_weight", ">= 0"),
        (
            [
                "distill.teacher=tiny:1",
                "distill.objective=topk_forward_kl",
                "actor.sequence_parallel_size=2",
                "trainer.procs_per_node=2",
                "trainer.cpus_per_proc=1",
                "actor.micro_batch_size=64",
            ],
            "distill.objective",
            "sequence parallelism",
        ),
        (["distill.teacher=tiny:1", "distill.top_k=21"], "distill.top_k", "1..20"),
        (
            ["distill.teacher=tiny:1", "distill.placement=colocated", "distill.procs_per_node=2"],
            "distill.procs_per_node",
            "placement=separate",
        ),
        (
            ["distill.teacher=tiny:1", "distill.engine=hf", "distill.tensor_parallel_size=2"],
            "distill.tensor_parallel_size",
            "engine=vllm",
        ),
    ],
)
def test_distill_config_mistakes_are_refused_before_ray(
    overrides: list[str], key: str, text: str
) -> None:
    check_config_error("+recipe=grpo_tiny", *overrides, key=key, text=text, before_ray=True)


def test_a_vision_language_student_is_refused_before_ray() -> None:
    check_config_error(
        "+recipe=vlm_tiny",
        "distill.teacher=tiny-vl:1",
        "distill.placement=colocated",
        key="distill.teacher",
        text="vision-language",
        before_ray=True,
    )


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path: Path) -> None:
    """Same ids for the same text, or one line naming the teacher's key."""
    import json

    from rlframe.data.tiny_model import build_tiny_tokenizer

    ours, same, other = tmp_path / "student", tmp_path / "same", tmp_path / "other"
    for folder in (ours, same, other):
        build_tiny_tokenizer().save_pretrained(folder)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    check_same_vocab(str(ours), str(same), "distill.teacher")
    with pytest.raises(ConfigError, match="distill.teachers.x: .*tokenizer differs"):
        check_same_vocab(str(ours), str(other), "distill.teachers.x")


def test_topk_forward_kl_by_hand_and_its_gradient_reaches_unsampled_tokens() -> None:
    """Teacher top-2 log-probs [log .75, log .25] (already a distribution); student log-probs
    of those ids [log .5, log .25]: KL = .75 ln(.75/.5) + .25 ln(.25/.25) = .75 ln 1.5. The
    gradient on the student's top-k log-probs is -q: [-.75, -.25] (divided by the tokens)."""
    import math

    from rlframe.algorithms.losses import compute_topk_forward_kl

    teacher = torch.tensor([[[math.log(0.75), math.log(0.25)]]])
    student = torch.tensor([[[math.log(0.5), math.log(0.25)]]], requires_grad=True)
    kl = compute_topk_forward_kl(student, teacher)
    assert kl.item() == pytest.approx(0.75 * math.log(1.5), abs=1e-6)
    kl.sum().backward()
    assert student.grad is not None
    torch.testing.assert_close(student.grad, torch.tensor([[[-0.75, -0.25]]]))


def test_chunked_logprobs_of_k_ids_a_position_match_plain_autograd() -> None:
    """[N, K] targets through the chunked head (recomputed in backward): values and the
    gradients of hidden states and head equal those of the full [N, V] softmax."""
    from workers.training.token_logprobs import compute_token_logprobs

    torch.manual_seed(0)
    hidden = torch.randn(7, 16, dtype=torch.float32, requires_grad=True)
    weight = torch.randn(11, 16, dtype=torch.float32, requires_grad=True)
    targets = torch.randint(11, (7, 3))
    targets[0] = torch.tensor([4, 4, 2])  # a repeated id: its gradients add up
    weights = torch.randn(7, 3, dtype=torch.float32)
    chunked = compute_token_logprobs(hidden, weight, targets, 1.0, chunk=3, with_entropy=False)
    (chunked.logprobs * weights).sum().backward()
    grads = hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    full = torch.log_softmax(hidden @ weight.t(), -1).gather(-1, targets)
    (full * weights).sum().backward()
    # fp32 both ways: equal to rounding (a dropped or misplaced id is off by ~1).
    torch.testing.assert_close(chunked.logprobs, full.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-4, atol=1e-5)
