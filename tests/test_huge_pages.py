"""Weights on transparent huge pages (``runtime.huge_pages``): the same values, shapes and dtypes, tied
parameters still tied, small tensors left alone. Whether the kernel grants huge pages is the system's matter
(THP may be off): the test checks the placement, not the page size."""

import torch

from moe_offload.runtime import huge_pages


def test_empty_and_copy_of():
    t = huge_pages.empty((3, 1 << 20), torch.bfloat16)
    assert t.shape == (3, 1 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    if huge_pages._ADVICE is not None:
        assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    src = torch.randn(5, 1 << 20)
    c = huge_pages.copy_of(src)
    assert torch.equal(c, src) and c.data_ptr() != src.data_ptr()
    small = huge_pages.empty((4, 4), torch.float32)
    assert small.shape == (4, 4) and small.data_ptr() % 4096 == 0  # page-aligned: direct reads may land there


def test_io_buffer_is_aligned_whatever_its_size():
    """Where direct reads land (``io_buffer``): exactly the bytes asked for, 2 MiB-aligned where huge pages can be
    advised (page-aligned anyway), writable."""
    for n in (4096, 2654208, 5 << 20):
        b = huge_pages.io_buffer(n)
        assert b.shape == (n,) and b.dtype == torch.uint8 and b.data_ptr() % 4096 == 0
        if huge_pages._ADVICE is not None:
            assert b.data_ptr() % huge_pages.HUGE_PAGE == 0
        b.fill_(7)
        assert int(b[-1]) == 7


def test_rehome_parameters_keeps_values_and_ties():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(4096, 512)
    head = torch.nn.Linear(512, 4096, bias=False)
    head.weight = emb.weight                       # tied, as an LM head often is
    norm = torch.nn.LayerNorm(512)
    model = torch.nn.ModuleDict(dict(emb=emb, head=head, norm=norm))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ptr = norm.weight.data_ptr()
    moved = huge_pages.rehome_parameters(model)
    assert moved == 4096 * 512 * 4                 # the tied weight once; the small norm left alone
    assert head.weight is emb.weight and norm.weight.data_ptr() == ptr
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])


def test_storage_is_the_tensors_bytes():
    """Memory accounting (``serve.memory_profile.storage_bytes``) sees a tensor's own bytes, not its mapping's."""
    t = huge_pages.empty((3, 1 << 20), torch.float32)
    assert t.untyped_storage().nbytes() == 3 * (1 << 20) * 4
