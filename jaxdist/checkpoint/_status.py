"""What `Checkpoint.restore` and `Checkpoint.read` return: TF's load status, for the idioms
that call it (``ckpt.restore(manager.latest_checkpoint).expect_partial()``)."""

from __future__ import annotations


class LoadStatus:
    """The result of `Checkpoint.restore` / `Checkpoint.read` (TF's load status object).

    A jaxdist restore is all or nothing: when it returns, every item of the checkpoint
    matched one of the `Checkpoint`'s and was restored, so the assertions hold and return
    the status. After ``restore(None)`` (no checkpoint yet: nothing was restored) they
    raise ``AssertionError``, as TF's initialization-only status does. `expect_partial`
    returns the status in both cases.

    Attributes:
        save_path: the checkpoint directory restored from, or None.
    """

    __slots__ = ("save_path",)

    def __init__(self, save_path: str | None) -> None:
        self.save_path = save_path

    def __repr__(self) -> str:
        return f"LoadStatus(save_path={self.save_path!r})"

    def _restored(self, method: str) -> LoadStatus:
        if self.save_path is None:
            raise AssertionError(
                f"LoadStatus.{method}: no checkpoint was given (save_path=None), so nothing "
                "was restored."
            )
        return self

    def assert_consumed(self) -> LoadStatus:
        """Every item of the checkpoint and of the `Checkpoint` was matched."""
        return self._restored("assert_consumed")

    def assert_existing_objects_matched(self) -> LoadStatus:
        """Every item of the `Checkpoint` was restored."""
        return self._restored("assert_existing_objects_matched")

    def assert_nontrivial_match(self) -> LoadStatus:
        """Something was restored."""
        return self._restored("assert_nontrivial_match")

    def expect_partial(self) -> LoadStatus:
        """TF's silencing of warnings about unmatched values; there are none here."""
        return self
