"""LLDS: gates and penalty against hand-computed values, nothing at all when every likelihood rose, and on a tiny
language model the thing it is for: GRPO steps that lower a correct trajectory's likelihood lower it less."""
import pytest
import torch

from megatron_searchr1.algo.advantages import compute_grpo_outcome_advantage, outcome_token_rewards
from megatron_searchr1.algo.llds import action_spans, compute_llds_loss, last_action_mask
from megatron_searchr1.algo.losses import compute_policy_loss

NAN = float("nan")


def _batch():
    """4 rows; old log-prob -1 (row 1: -2); `decrease` = old - new per token."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1],    # row 0, A=+1: two actions around a retrieved block
                         [1, 1, 0, 0, 0, 0],    # row 1, A=-1: its likelihood fell, but A < 0
                         [1, 1, 0, 0, 0, 0],    # row 2, A=+0.5: one action, summed decrease < 0
                         [1, 0, 1, 1, 0, 0]])   # row 3, A=+1: action 0 fell, action 1 rose more
    decrease = torch.tensor([[0.4, -0.3, 0.0, 0.0, 0.2, 0.1],
                             [1.0, 1.0, 0.0, 0.0, 0.0, 0.0],
                             [0.5, -0.6, 0.0, 0.0, 0.0, 0.0],
                             [0.5, 0.0, -0.1, -0.6, 0.0, 0.0]])
    old = torch.full((4, 6), -1.0)
    old[1] = -2.0
    new = old - decrease
    new[mask == 0] = NAN  # retrieved tokens and padding: whatever sits there must not matter
    adv = torch.tensor([1.0, -1.0, 0.5, 1.0])[:, None].expand(4, 6).clone()
    return old, new.requires_grad_(True), adv, mask


def test_action_gate_by_hand():
    old, new, adv, mask = _batch()
    pen, m = compute_llds_loss(old, new, adv, mask, coef=2.0, gate="action")
    # row 0: action (0.4, -0.3) sums 0.1 > 0: open, max(0, .) = 0.4 + 0; action (0.2, 0.1) sums 0.3: open, 0.3
    # row 1: A < 0: nothing.  row 2: (0.5, -0.6) sums -0.1: closed, although its first token fell
    # row 3: action (0.5): open, 0.5; action (-0.1, -0.6): closed
    # token-mean over the 11 mask-1 tokens, times coef 2
    assert pen.item() == pytest.approx(2.0 * (0.4 + 0.3 + 0.5) / 11)
    # actions of the A >= 0 rows: row 0 two open, row 2 one closed, row 3 one of two open: 3/5
    assert m["llds_action_gate_frac"].item() == pytest.approx(3 / 5)
    # responses of the A >= 0 rows: row 0 sums 0.4 > 0 open; row 2 -0.1 and row 3 -0.2 closed: 1/3
    assert m["llds_response_gate_frac"].item() == pytest.approx(1 / 3)
    assert (m["logp_pos_mean"].item(), m["logp_neg_mean"].item()) == (-1.0, -2.0)
    pen.backward()
    # the penalty raises exactly the gated tokens whose log-prob fell, each by coef / 11
    g = -2.0 / 11
    assert torch.isfinite(new.grad).all()
    assert new.grad.tolist() == [pytest.approx(row) for row in [[g, 0, 0, 0, g, g], [0] * 6, [0] * 6,
                                                                 [g, 0, 0, 0, 0, 0]]]


def test_response_gate_by_hand():
    old, new, adv, mask = _batch()
    pen, _ = compute_llds_loss(old, new, adv, mask, coef=2.0, gate="response")
    # only row 0's response fell overall (0.4 - 0.3 + 0.2 + 0.1 = 0.4): its falling tokens 0.4, 0.2, 0.1
    assert pen.item() == pytest.approx(2.0 * (0.4 + 0.2 + 0.1) / 11)


def test_answer_coef_weighs_the_answer_span():
    old, new, adv, mask = _batch()
    pen, _ = compute_llds_loss(old, new, adv, mask, coef=1.0, answer_coef=0.5, gate="action")
    # last actions: row 0 (0.2, 0.1) -> x0.5; row 3's last action is closed; row 0's first action stays x1
    assert pen.item() == pytest.approx((0.4 + 0.5 * 0.3 + 0.5) / 11)
    # the reference (LLDS dp_actor.py) takes min(answer weight, coef): an answer_coef above coef changes nothing
    capped, _ = compute_llds_loss(old, new, adv, mask, coef=1.0, answer_coef=10.0, gate="action")
    plain, _ = compute_llds_loss(old, new, adv, mask, coef=1.0, gate="action")
    assert capped.item() == pytest.approx(plain.item()) == pytest.approx((0.4 + 0.3 + 0.5) / 11)
    answer = torch.zeros(4, 6, dtype=torch.bool)
    answer[3, 0] = True  # say the answer sat in row 3's first action
    pen, _ = compute_llds_loss(old, new, adv, mask, coef=1.0, answer_coef=0.0, answer_mask=answer)
    assert pen.item() == pytest.approx((0.4 + 0.3 + 0.0) / 11)


def test_gate_closed_when_every_likelihood_rose_leaves_the_plain_loss():
    old = torch.tensor([[-1.0, -2.0, -1.5, -0.5], [-1.0, -1.0, -3.0, -0.2]])
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 0]])
    adv = torch.tensor([[1.0] * 4, [0.5] * 4])
    rise = torch.tensor([[0.1, 0.3, -5.0, 0.05], [0.2, 0.01, 0.1, -1.0]])  # mask-0 entries may do anything
    grads = []
    for coef in (0.0, 1.0):
        new = (old + rise).requires_grad_(True)
        loss = compute_policy_loss(old, new, adv, mask, cliprange=0.2)[0]
        pen, m = compute_llds_loss(old, new, adv, mask, coef=coef, gate="action")
        assert pen.item() == 0.0 and m["llds_action_gate_frac"].item() == 0.0
        (loss + pen).backward()
        grads.append((loss + pen).item())
        grads.append(new.grad.tolist())
    assert grads[0] == grads[2] and grads[1] == grads[3]


def test_spans_and_last_action():
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    assert action_spans(mask).tolist() == [[-1, 0, 0, -1, 1], [0, 0, 0, 0, 0], [-1] * 5]
    assert last_action_mask(mask).tolist() == [[False, False, False, False, True], [True] * 5, [False] * 5]
    with pytest.raises(ValueError, match="choose one of response, action"):
        compute_llds_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), coef=1.0,
                          gate="token")


# --- what LLDS is for --------------------------------------------------------------------------------------------
BOS, S, U, W, X = range(5)  # S: a search action, U: the right answer, W / X: wrong answers


class BigramLM(torch.nn.Module):
    """Embedding + linear over the previous token: a model small enough to watch a likelihood move."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 4)
        self.out = torch.nn.Linear(4, 5)

    def forward(self, ids):  # (B, L) -> (B, L-1) log-prob of each next token
        logp = torch.log_softmax(self.out(self.emb(ids[:, :-1])), dim=-1)
        return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)


# One group of four. The correct trajectory searches once and answers (S U). The wrong ones repeat exactly that
# search-answer step and then go on (S U S U S U S W): every token of the correct response, in its own context,
# appears more often in the wrong ones. GRPO's advantages sum to 0 over the group (+1.5, 3 x -0.5), so with a
# token-mean loss the net push on S->U is 1.5 - 3 * 3 * 0.5 < 0: the correct trajectory's likelihood falls.
SEQS = torch.tensor([[BOS, S, U, 0, 0, 0, 0, 0, 0], [BOS, S, U, S, U, S, U, S, W], [BOS, S, U, S, U, S, U, S, W],
                     [BOS, S, U, S, U, S, U, S, X]])
MASK = torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0], [1] * 8, [1] * 8, [1] * 8])


def _train(seed: int, llds_coef: float, steps: int = 10, lr: float = 0.1) -> tuple[float, float, float]:
    """(correct trajectory's log-likelihood before, after one step, after `steps` steps) of PPO-clip GRPO updates
    on one rollout (old log-probs fixed at the start, as over the mini-batches of one step)."""
    torch.manual_seed(seed)
    model = BigramLM().double()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    adv, _ = compute_grpo_outcome_advantage(outcome_token_rewards([1.0, 0.0, 0.0, 0.0], MASK), MASK, [0, 0, 0, 0])
    with torch.no_grad():
        old = model(SEQS)
    history = [(old[0] * MASK[0]).sum().item()]
    for _ in range(steps):
        log_prob = model(SEQS)
        loss = compute_policy_loss(old, log_prob, adv, MASK, cliprange=0.2)[0]
        if llds_coef:
            loss = loss + compute_llds_loss(old, log_prob, adv, MASK, coef=llds_coef, gate="action")[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            history.append((model(SEQS)[0] * MASK[0]).sum().item())
    return history[0], history[1], history[-1]


@pytest.mark.parametrize("seed", range(8))
def test_llds_lowers_the_correct_trajectory_less_than_plain_grpo(seed):
    start, first, plain_end = _train(seed, llds_coef=0.0)
    assert plain_end < start  # plain GRPO displaces the correct trajectory's likelihood
    start_l, first_l, llds_end = _train(seed, llds_coef=2.0)
    # same seed and data; the first step is the same (log_prob == old_log_prob: nothing has fallen yet) ...
    assert (start_l, first_l) == (start, first)
    # ... after it LLDS pushes the fallen tokens back: at most half of plain GRPO's drop remains
    assert start - llds_end < 0.5 * (start - plain_end)


def test_gates_span_mask_times_nonnegative_advantage_as_the_reference():
    """Under GAE the advantage varies within a response. The LLDS reference (dp_actor.py) forms its gates over
    mask x [A >= 0]: actions are the runs of such tokens, and a token with A < 0 never counts in a gate's sum.
    Row: advantages (1, -1, 1, 1), log-prob changes -0.2, -0.5, +0.3, -0.1 (old 0):
    - action gate: runs {0} (sum 0.2 > 0: open) and {2, 3} (-0.3 + 0.1 < 0: closed) -> 0.2 / 4 tokens;
    - response gate: 0.2 - 0.3 + 0.1 = 0, not > 0: closed -> 0.
    On main the A < 0 token's fall (0.5) joined the sums: one action, open, 0.3 / 4, and the response gate open."""
    old, new = torch.zeros(1, 4), torch.tensor([[-0.2, -0.5, 0.3, -0.1]])
    adv, mask = torch.tensor([[1.0, -1.0, 1.0, 1.0]]), torch.ones(1, 4)
    pen, m = compute_llds_loss(old, new, adv, mask, coef=1.0, gate="action")
    assert pen.item() == pytest.approx(0.2 / 4)
    assert m["llds_action_gate_frac"].item() == pytest.approx(1 / 2)
    pen, _ = compute_llds_loss(old, new, adv, mask, coef=1.0, gate="response")
    assert pen.item() == 0.0
    # under GRPO (one advantage per row) nothing changes: the gates are the mask's
    grpo = torch.ones(1, 4)
    pen, _ = compute_llds_loss(old, new, grpo, mask, coef=1.0, gate="action")
    assert pen.item() == pytest.approx((0.2 + 0.5 + 0.1) / 4)


def test_adaptive_answer_weight_is_the_references():
    """LLDS reference: answer weight = answer lambda x max(mean valid searches - 1, 0), then min with the main
    lambda. A batch that searched 2.5 times on average: 0.2 x 1.5 = 0.3, capped at coef 0.25; one that searched
    once: 0 (the answer is not held)."""
    from megatron_searchr1.algo.llds import llds_answer_weight

    assert llds_answer_weight(0.2, 2.5) == pytest.approx(0.3)
    assert llds_answer_weight(0.2, 1.0) == 0.0 and llds_answer_weight(0.2) == 0.2
    old, new = torch.zeros(1, 4), torch.tensor([[-0.1, -0.1, 0.0, -0.4]])
    mask = torch.tensor([[1, 1, 0, 1]])  # two actions; the last (token 3) is the answer
    for mean_searches, answer_w in ((2.5, 0.25), (1.0, 0.0)):
        pen, _ = compute_llds_loss(old, new, torch.ones(1, 4), mask, coef=0.25,
                                   answer_coef=llds_answer_weight(0.2, mean_searches))
        assert pen.item() == pytest.approx((0.25 * 0.2 + answer_w * 0.4) / 3)
