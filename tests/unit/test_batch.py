import torch
from rlrun.batch import collate, read_batch, write_batch

from tests.support.samples import sample


def test_collate_aligns_logprobs_with_next_token_targets():
    a, b = sample(1, 0, 0, advantage=0.25), sample(1, 1, 0, advantage=-0.25)
    b = type(b)(
        prompt_ids=[3, 4],
        completion_ids=[7, 8, 0],
        logprobs=[-1.0, -2.0, -3.0],
        advantage=-0.25,
        reward=0.1,
        trace=b.trace,
    )
    t = collate([a, b], pad_id=0)
    assert t["input_ids"].tolist() == [[3, 4, 9, 5, 0], [3, 4, 7, 8, 0]]
    assert t["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    # targets are input_ids[:, 1:]; completion of a starts at position 3, predicted from position 2
    assert t["loss_mask"].tolist() == [[False, False, True, True], [False, True, True, True]]
    assert torch.allclose(t["old_logprobs"], torch.tensor([[0.0, 0.0, -0.1, -0.2], [0.0, -1.0, -2.0, -3.0]]))
    assert t["advantages"].tolist() == [0.25, -0.25]


def test_collate_pads_short_samples():
    short = sample(2, 0, 0)
    long = type(short)([1], [2, 3, 4, 5, 0], [-1.0] * 5, 0.1, 0.2, short.trace)
    t = collate([short, long], pad_id=0)
    assert t["input_ids"].shape == (2, 6)
    assert t["attention_mask"][0].tolist() == [1, 1, 1, 1, 1, 0]
    assert t["loss_mask"][0].tolist() == [False, False, True, True, False]


def test_write_then_read_batch(tmp_path):
    samples = [sample(1, m, 3, advantage=0.1 * m) for m in range(4)]
    path = write_batch(tmp_path / "rollouts" / "step_4", 4, samples, pad_id=0)
    batch = read_batch(path)
    assert batch.num_samples == 4 and batch.meta["step"] == 4
    assert batch.meta["traces"][2] == {
        "env": "reverse-text",
        "policy_version": 3,
        "group_id": 1,
        "member": 2,
        "episode_id": "1/2",
    }
    assert torch.allclose(batch.advantages, torch.tensor([0.0, 0.1, 0.2, 0.3]))
    assert not list((tmp_path / "rollouts").glob(".*"))  # no temporary directory left behind
