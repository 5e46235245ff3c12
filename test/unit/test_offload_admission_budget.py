"""The physical budget an offloaded prefill is admitted against (``upstream.scheduler.physical_check``
on the ``PrefillBudget`` subclass that the allocator's ``create_prefill_budget`` seam returns with
elastic KV): inside, upstream's check sees only what the device must hold now; afterwards the
running requests' reservations are intact and only what the admission allocates now is added
(the offloaded request's own decode tokens are never reserved)."""

import types

from sglang.srt.mem_cache.prefill_budget import PrefillBudget

from sglang_memx.upstream.scheduler import new_physical_budget, physical_check


def _budget(available, evictable=0):
    allocator = types.SimpleNamespace(page_size=1, available_size=lambda: available)
    tree = types.SimpleNamespace(supports_mamba=lambda: False, evictable_size=lambda: evictable)
    budget = new_physical_budget(allocator, tree, 0)
    assert isinstance(budget, PrefillBudget)
    return budget


def test_reservations_refuse_but_the_physical_budget_admits():
    budget = _budget(available=300, evictable=40)
    budget.total_offset = 500  # the running requests' reserved decode tokens
    prompt, max_new = 100, 50
    total_tokens = prompt + max_new + 1  # what upstream's add_one_req asks for
    assert (
        budget.check_prefill(
            extend_input_len=prompt,
            total_tokens=total_tokens,
            max_new_tokens=max_new,
            input_tokens=prompt,
            swa_host_hit_length=0,
            chunk_limit=None,
        )[0]
        is False
    )
    with physical_check(budget, headroom=3, max_new=max_new):
        # prompt + page must fit free + evictable (340) minus one decode step (3): 101 < 337
        ok, _ = budget.check_prefill(
            extend_input_len=prompt,
            total_tokens=total_tokens,
            max_new_tokens=max_new,
            input_tokens=prompt,
            swa_host_hit_length=0,
            chunk_limit=None,
        )
        assert ok
        budget.reserve(prompt, max_new)  # what upstream's commit does
    assert budget.current_offset == 101
    assert budget.total_offset == 500 + 101  # reservations kept, this request's 50 decode tokens not added


def test_a_prompt_larger_than_the_free_memory_is_refused_even_physically():
    budget = _budget(available=120)
    with physical_check(budget, headroom=30, max_new=50):
        ok, _ = budget.check_prefill(
            extend_input_len=100,
            total_tokens=151,
            max_new_tokens=50,
            input_tokens=100,
            swa_host_hit_length=0,
            chunk_limit=None,
        )
    assert not ok  # 101 + 30 (one decode step of 29 running requests + 1) > 120
    assert budget.total_offset == 0 and budget.current_offset == 0  # nothing admitted, nothing changed


def test_outside_a_physical_check_the_budget_is_upstreams():
    budget = _budget(available=300, evictable=40)
    budget.total_offset = 500
    reference = PrefillBudget(budget.allocator, budget.tree_cache)
    reference.total_offset = 500
    assert budget.remaining_total == reference.remaining_total == 340 - 500
    budget.reserve(100, 50)
    reference.reserve(100, 50)
    assert (budget.total_offset, budget.current_offset) == (reference.total_offset, reference.current_offset)
