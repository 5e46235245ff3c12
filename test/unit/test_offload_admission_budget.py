"""The physical budget an offloaded prefill is admitted against (hooks.scheduler._PhysicalBudget),
on upstream's real PrefillBudget: inside, upstream's check sees only what the device must hold
now; afterwards the running requests' reservations are intact and only what the admission
allocates now is added (the offloaded request's own decode tokens are never reserved)."""

import types

from sglang.srt.mem_cache.prefill_budget import PrefillBudget

from sglang_memx.hooks.scheduler import _PhysicalBudget


def _budget(available, evictable=0):
    allocator = types.SimpleNamespace(page_size=1, available_size=lambda: available)
    tree = types.SimpleNamespace(supports_mamba=lambda: False, evictable_size=lambda: evictable)
    return PrefillBudget(allocator, tree)


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
    with _PhysicalBudget(budget, max_new, headroom=3):
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
    with _PhysicalBudget(budget, max_new=50, headroom=30):
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
