"""KV transfer between managers: publish what this cache holds, retrieve what
another published.

`publish` leases what it names (R33, `kvref.transfer.lease`) and stamps each stream's
generation; a retrieve takes pages and starts an asynchronous copy under the
stream table's lock, after checking the publisher still holds those
generations (R35); the stream reads as pending until the copy lands, and a
failed or stale copy is latched on it (I11) until reset or removal.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

from kvref.core.errors import (
    KVRefError,
    PublishedInfoError,
    StepInFlightError,
)
from kvref.core.groups import GROUP_SEP
from kvref.core.steps import StepForks
from kvref.core.stream_table import StreamTable, pages_for
from kvref.core.streams import CacheStream
from kvref.stepping import admission
from kvref.stepping.plan import SINK_PAGE
from kvref.stepping.step import (
    AdmitFailedReason,
    AdmitOutcome,
    AdmitRuntimeError,
    AllocationFailed,
    ForkPending,
    PublishLeased,
    RequestOffloading,
    RetrieveInProgress,
    WindowPending,
)
from kvref.transfer.engine import KVTransferManager, StaleSourceError, TransferError
from kvref.transfer.published import (
    KVSequenceInfo,
    PublishedKVInfo,
    PublishRefused,
    RetrieveAborted,
    RetrieveStale,
    UnknownRequest,
)

logger = logging.getLogger(__name__)


class Retrieval:
    """Publish and retrieve over one stream table and one transfer engine."""

    def __init__(self, table: StreamTable, transfer: KVTransferManager, rank: int,
                 world_size: int, name: str, stepping: StepForks) -> None:
        self._table = table
        # the step mechanism, asked through `StepForks` only
        self._stepping = stepping
        self._transfer = transfer
        self._rank = rank
        self._world_size = world_size
        self._name = name  # the manager's, for the log
        # a consumer in this process checks our generations through the transfer
        # engine's registry (R35)
        transfer.serve_generations(self.generation_of)

    def own_transfer_info(self) -> Any:
        return self._transfer.get_kv_transfer_info()

    def generation_of(self, rid: str, label: str) -> int | None:
        """The generation of (rid, label) now; None once it is gone. Read by a
        consumer's retrieve without this manager's lock (a consumer holds its
        own; taking ours too could deadlock two managers retrieving from each
        other): one atomic lookup and an int, and the copy reads it again after
        it copied (a sequence lock)."""
        stream = self._table.streams.get(rid, {}).get(label)
        return None if stream is None else stream.generation

    def publish(self, request_id: str) -> PublishedKVInfo | PublishRefused:
        """See `KVManager.publish`."""
        transfer_info = self.own_transfer_info()
        ps = self._table.page_size
        with self._table.lock:
            streams = self._table.streams.get(request_id)
            if streams is None:
                # a value, not an error: remove_request may run on another thread
                # between the engine's forward and this publish (R48)
                return PublishRefused(UnknownRequest(
                    message="unknown request (never ingested, or removed): nothing to "
                    "publish", request_id=request_id))
            refused: AdmitFailedReason | None = self._publish_refusal(request_id, streams)
            if refused is None and self._stepping.forks_pending(request_id):
                # under the lease, nothing may overwrite what it names (R50)
                refused = ForkPending(
                    message="a running or staged step still forks onto this request: "
                            "publish once it committed", request_id=request_id)
            if refused is None and self._stepping.release_pending(request_id):
                # that commit would release pages the lease would name (R70)
                refused = WindowPending(
                    message="a running or staged step's commit releases window pages of "
                            "this request: publish once it committed", request_id=request_id)
            if refused is not None:
                return PublishRefused(refused)
            # a windowed stream names its retained pages only, from slot
            # released // ps, and says how much it released (W17)
            seq_info = {
                label: KVSequenceInfo(
                    seq_len=s.stored_len,
                    latest_kv_transfer_info=transfer_info,
                    page_indices=list(s.page_indices[
                        : pages_for(s.stored_len, ps) - s.released // ps]),
                    generation=s.generation,
                    released=s.released,
                )
                for label, s in streams.items()
            }
            self._table.leases.take(request_id)  # publishing again renews the lease (R34)
        return PublishedKVInfo.build_for_rank(self._rank, self._world_size, seq_info,
                                              request_id=request_id)

    @staticmethod
    def _publish_refusal(rid: str, streams: dict[str, CacheStream]
                         ) -> RequestOffloading | RetrieveInProgress | AdmitRuntimeError | None:
        """Why these streams' pages do not hold what their lengths count (R13, R21)."""
        for label, s in streams.items():
            if s.offloaded:
                return RequestOffloading(message="offloaded: reload it, then publish",
                                         request_id=rid, label=label)
        states = {label: admission.retrieve_state(s) for label, s in streams.items()}
        for label, state in states.items():
            if state == admission.FAILED:
                return AdmitRuntimeError("its retrieve failed (latched)",
                                         request_id=rid, label=label)
        for label, state in states.items():
            if state == admission.PENDING:
                return RetrieveInProgress(message="still receiving a retrieve",
                                          request_id=rid, label=label)
        return None

    def release_published(self, request_id: str) -> None:
        """See `KVManager.release_published`."""
        with self._table.lock:
            self._table.leases.release(request_id)

    def admit_retrieve(
        self,
        rid: str,
        node_name: str | None,
        graph_walk: str | None,
        published: PublishedKVInfo | None,
    ) -> AdmitOutcome:
        """See `KVManager.admit_retrieve`."""
        if published is not None and published.world_size != self._world_size:
            # terminal for this request, not for the worker serving it
            return AdmitOutcome(
                ok=False, ready=False,
                reason=AdmitRuntimeError(
                    "KV transfer across tensor-parallel world sizes is not supported "
                    f"(published {published.world_size}, local {self._world_size})",
                    request_id=rid,
                ),
            )
        own = self.own_transfer_info()
        ps = self._table.page_size
        # one critical section: reading stored_len, comparing it with what was
        # published and starting the copy must not interleave a commit or reset
        with self._table.lock:
            streams = self._table.request(rid)
            offered = published.get(self._rank).items() if published is not None else ()
            if node_name is None and graph_walk is None:
                # no graph: every label published, and every label held (R37)
                needed: tuple[str, ...] = tuple(dict.fromkeys(
                    [label for label, _ in offered] + list(streams)))
            else:
                needed = self._table.overrides[rid].get_labels(node_name or "", graph_walk or "")
            todo: list[tuple[str, KVSequenceInfo, int]] = []
            new_pages = 0
            for label, info in offered:
                if label not in needed:
                    continue
                ready, failed = self._check_ready(rid, label)
                if failed is not None:
                    return AdmitOutcome(ok=False, ready=False, reason=failed)
                if not ready:
                    return AdmitOutcome(ok=True, ready=False)
                stream = streams.get(label)
                old_len = stream.stored_len if stream is not None else 0
                if info.seq_len <= old_len:
                    continue
                if info.latest_kv_transfer_info == own:
                    # the pages already are in this cache; opening our own
                    # IPC handle would fail with an invalid device context
                    logger.warning(
                        "KV %s: skipping self-retrieve for %r label %r (published %d, held %d)",
                        self._name, rid, label, info.seq_len, old_len,
                    )
                    continue
                # every misuse before anything moves: a bad descriptor or an
                # incompatible publisher found at the second label used to
                # leave the first one's pages taken and its copy running
                self._validate_published(rid, label, info, old_len)
                if stream is not None and stream.step_in_flight:
                    # the step planned its writes at the old length; growing
                    # the stream under it would overwrite or lose its tokens
                    raise StepInFlightError(
                        "retrieve into a stream with a step in flight; commit it first",
                        request_id=rid, label=label,
                    )
                if stream is not None and stream.offloaded:
                    return AdmitOutcome(ok=False, reason=admission.request_offloading(
                        rid, label))
                released = self._released_after(label, stream, info)
                kept = self._kept(stream, released)
                new_pages += max(0, pages_for(info.seq_len, ps) - released // ps - len(kept))
                cow = stream is not None and old_len >= released and (
                    self._table.sharing.cow_needed((rid, label), stream))
                if cow:
                    new_pages += 1  # its shared partial page is copied first (R52)
                leased = self._gives_back_leased(rid, label, stream, released, cow)
                if leased is not None:
                    return AdmitOutcome(ok=False, reason=leased)
                todo.append((label, info, old_len))
            source = published.request_id if published is not None else None
            stale = [label for label, info, _ in todo if self._transfer.source_current(
                info.latest_kv_transfer_info, source, label, info.generation) is False]
            if stale:
                return self._latch_stale(rid, streams, stale)
            free = self._table.pages.num_free
            if new_pages > free:
                label = todo[0][0]
                return AdmitOutcome(ok=False, reason=AllocationFailed(
                    pages_short=new_pages - free, request_id=rid, label=label,
                    message=f"retrieve needs {new_pages} new pages, {free} free",
                ))
            started: list[str] = []
            # label -> the error its groups latch: a later group's copy could
            # not start once an earlier group's had (H1, `_abort`)
            aborted: dict[str, TransferError] = {}
            for label, info, old_len in todo:
                user = label.split(GROUP_SEP, 1)[0]
                refused = self._start_retrieve(rid, streams, label, info, old_len, source,
                                               failed=aborted.get(user))
                if refused is not None:
                    if not any(lb.split(GROUP_SEP, 1)[0] == user for lb in started):
                        self._abort(streams, aborted)
                        return AdmitOutcome(ok=False, ready=False, reason=refused)
                    aborted[user] = TransferError(
                        f"the copy of {label!r} could not start after another group of "
                        f"its label started its own ({refused.message}): reset the request")
                    again = self._start_retrieve(rid, streams, label, info, old_len, source,
                                                 failed=aborted[user])
                    assert again is None, again
                started.append(label)
            self._pend_with_label(streams, started)
            if aborted:
                self._abort(streams, aborted)
                user, err = next(iter(aborted.items()))
                return AdmitOutcome(ok=False, ready=False, reason=RetrieveAborted(
                    str(err), request_id=rid, label=user))
            ready = True
            for label in needed:
                label_ready, failed = self._check_ready(rid, label)
                if failed is not None:
                    return AdmitOutcome(ok=False, ready=False, reason=failed)
                ready = ready and label_ready
            return AdmitOutcome(ok=True, ready=ready)

    @staticmethod
    def _pend_with_label(streams: dict[str, CacheStream], started: list[str]) -> None:
        """A group whose copy range was empty (a chunk starting at the new
        length reads none of it, W16 and H7) started no copy; it is pending
        with its label's copy all the same, and done when that is (H1: a
        label's groups move together; idle, a second retrieve would grow it
        alone while the others still copy)."""
        copying: dict[str, Future[Any]] = {}
        for label in started:
            fut = streams[label].read_future
            if fut is not None:
                copying.setdefault(label.split(GROUP_SEP, 1)[0], fut)
        for label in started:
            stream = streams[label]
            fut = copying.get(label.split(GROUP_SEP, 1)[0])
            if stream.read_future is None and stream.read_error is None and fut is not None:
                stream.wait_with(fut)

    @staticmethod
    def _latch_stale(rid: str, streams: dict[str, CacheStream], labels: list[str]
                     ) -> AdmitOutcome:
        """Refuse a retrieve of pages the publisher changed, gave back or reused
        since it published (R35): latched on each such label, as a failed copy
        (I11), before any page is taken, so nothing is copied."""
        for label in labels:
            stream = streams.get(label)
            if stream is None:
                stream = streams[label] = CacheStream()
            stream.fail_retrieve(StaleSourceError(
                "the publisher's stream changed generation since it published"))
        return AdmitOutcome(ok=False, ready=False, reason=RetrieveStale(
            f"published pages of {labels} changed since publish; reset the request "
            "and retrieve a fresh publication", request_id=rid, label=labels[0]))

    @staticmethod
    def _abort(streams: dict[str, CacheStream], aborted: dict[str, TransferError]) -> None:
        """Latch failed every group of each label in ``aborted``: a copy that
        could not start after a group of its label had started its own.
        H1 forbids refusing with that group still copying, and the started
        copy cannot be undone: it writes its pages until it ends, only a
        drain outside the lock (reset, remove) may wait for it, and the pages
        it took may have evicted cached pages whose keys are gone. So the
        struck group and those after it take their pages as if their copies
        had started and failed at once (`_start_retrieve`'s ``failed``), and
        every group is latched failed: the state of a label whose copy
        failed later (I11), its groups alike (I30). Each keeps what it took;
        the next reset drains the running copies before freeing, so no page
        is lost, or reused while written. Other labels keep copying."""
        for lb, stream in streams.items():
            err = aborted.get(lb.split(GROUP_SEP, 1)[0])
            if err is not None:
                stream.abort_retrieve(err)

    def _start_retrieve(self, rid: str, streams: dict[str, CacheStream], label: str,
                        info: KVSequenceInfo, old_len: int,
                        source: str | None = None, failed: BaseException | None = None
                        ) -> AdmitRuntimeError | None:
        """Take the pages and start one label's copy; if the transfer engine
        raises, give back what this label took and refuse (R26); the caller
        answers for the labels started before it (`_abort`). ``failed``: no
        copy is started, the pages are taken as for one that failed at once."""
        stream = streams.get(label)
        created = stream is None
        if stream is None:
            stream = streams[label] = CacheStream()
        ps = self._table.page_size
        released = self._released_after(label, stream, info)
        start = max(old_len, released)  # only retained tokens are copied (W16)
        kept = self._kept(stream, released)
        short = pages_for(info.seq_len, ps) - released // ps - len(kept)
        # the copy lands after the stream's last token, in its partial page:
        # one the stream shares is made private, as an admit's write is
        # (R52), into a page of its own (``cow``), which the copy names
        cow = old_len >= released and self._table.sharing.cow_needed((rid, label), stream)
        # counted by the caller, under the same lock; named to the copy but
        # taken only once it started: taking first evicted free-cached pages
        # that a failed start then gave back blank, their keys lost (the
        # shipped-configuration lockstep found the cache one page short), and
        # a copy-on-write made before a start that failed stayed made (the
        # nightly lockstep, 2026-12-05: a refused retrieve had moved a page)
        got = self._table.pages.peek(short + cow) if short + cow > 0 else []
        pages = kept + got[:short]  # slot released // ps onward
        if cow:
            # the partial page's slot among the kept ones (spare pages may
            # follow it: a reset that kept them, a step never committed); its
            # private page is the last one taken, as the model takes it
            tail = old_len // ps - max(released, stream.released) // ps
            shared, pages[tail] = pages[tail], got[-1]
        try:
            fut: Future[None] | None
            if failed is not None:
                done: Future[None] = Future()
                done.set_exception(failed)
                fut = done
            else:
                # both lists by position: a released slot (never read) names the sink
                fut = self._transfer.start_async_retrieve(
                    start_len=start, end_len=info.seq_len,
                    local_page_indices=[SINK_PAGE] * (released // ps) + pages,
                    remote_page_indices=self._remote_pages(info, ps),
                    kv_transfer_info=info.latest_kv_transfer_info,
                    source=(source, label, info.generation),
                )
        except Exception as err:
            if created:
                del streams[label]
            return AdmitRuntimeError(
                f"KV retrieve could not start: {type(err).__name__}: {err}",
                request_id=rid, label=label,
            )
        if got:
            taken = self._table.take((rid, label), short + cow)
            assert taken == got, f"peeked pages {got}, allocated {taken}"
        # the pages of slots now released go (tail first, W7); the copy writes
        # none of them. Set here, with stored_len: the copy's landing changes
        # neither (admission.retrieve_state only clears the future)
        gone = stream.page_indices[:len(stream.page_indices) - len(kept)]
        if cow:
            # the tokens before the copy's first slot, from the shared page:
            # slots the copy never writes, so the order of the two is free
            self._stepping.copy_page_head(shared, got[-1], old_len % ps)
            # let go of before the released slots' pages, as the model does:
            # the order they reach the free-cached list is the order evicted
            self._table.give_back((rid, label), [shared])
        # a peer's KV is never keyed into the prefix cache (R55)
        stream.start_retrieve(pages, released, fut, info.seq_len)
        self._table.give_back((rid, label), gone)
        return None

    def _gives_back_leased(self, rid: str, label: str, stream: CacheStream | None,
                           released: int, cow: bool) -> PublishLeased | None:
        """R71: a retrieve into a request whose own publication is leased would
        give back a page that publication names: a slot its window now
        releases (W16) under tokens it held, or its shared partial page, copied
        first (R52). Freed (or free-cached, then evicted), the page may be
        reused while a peer still copies it, and across processes nothing else
        tells that peer; so the retrieve waits for the lease to end, as a
        commit that would release such a page does (R70). Refused before
        anything moves."""
        if stream is None:
            return None  # a label the request lacks: no page of it is named
        ps = self._table.page_size
        named_released = min(released // ps, pages_for(stream.stored_len, ps))
        if not (cow or named_released > stream.released // ps):
            return None
        if not self._table.leases.held(rid):
            return None
        return PublishLeased(
            message=f"the retrieve would give back pages of {rid!r}/{label!r} that its "
                    "publication names: retry after release_published or the lease's end",
            request_id=rid, label=label)

    def _released_after(self, label: str, stream: CacheStream | None,
                        info: KVSequenceInfo) -> int:
        """The consumer's `released` once it holds the peer's tokens (W16): the
        most of its own, the peer's, and what a commit to ``seq_len`` would
        release (equal to the peer's when both share a retention config)."""
        own = stream.released if stream is not None else 0
        # the peer's: 0 unless this label releases (checked, W16)
        return self._table.behaviour(label).released_after(
            max(own, info.released), info.seq_len, self._table.page_size)

    def _kept(self, stream: CacheStream | None, released: int) -> list[int]:
        """The stream's pages of slots still retained at `released`."""
        if stream is None:
            return []
        ps = self._table.page_size
        return list(stream.page_indices[max(0, released // ps - stream.released // ps):])

    @staticmethod
    def _remote_pages(info: KVSequenceInfo, ps: int) -> list[int]:
        """The publisher's pages by position: its released slots name the sink."""
        return [SINK_PAGE] * (info.released // ps) + list(info.page_indices)

    def _validate_published(self, rid: str, label: str, info: KVSequenceInfo,
                            old_len: int) -> None:
        local_page_size = self._table.page_size
        remote = info.latest_kv_transfer_info
        num_pages = getattr(remote, "num_pages", None)
        page_size = getattr(remote, "page_size", local_page_size)
        if page_size != local_page_size:
            raise PublishedInfoError(
                f"published page size {page_size}, local {local_page_size}",
                request_id=rid, label=label,
            )
        released = info.released
        if (isinstance(released, bool) or not isinstance(released, int) or released < 0
                or released % page_size or released > info.seq_len):
            raise PublishedInfoError(
                f"published released={released!r}: whole pages of {page_size}, at most "
                f"seq_len {info.seq_len}", request_id=rid, label=label)
        behaviour = self._table.behaviour(label)
        first = behaviour.first_read(info.seq_len)
        if released > first:
            # the peer let go of tokens this label (all of them, for full
            # attention) still reads: another retention config (W16)
            raise PublishedInfoError(
                f"published {info.seq_len} tokens with the first {released} released; "
                f"this label's window starts at {first} ({behaviour})",
                request_id=rid, label=label)
        if len(info.page_indices) < pages_for(info.seq_len, page_size) - released // page_size:
            raise PublishedInfoError(
                f"published {info.seq_len} tokens ({released} released) over only "
                f"{len(info.page_indices)} pages", request_id=rid, label=label,
            )
        bad = [p for p in info.page_indices if p <= SINK_PAGE
               or (num_pages is not None and p >= num_pages)]
        if bad:
            raise PublishedInfoError(
                f"published page indices {bad[:4]} are outside [1, {num_pages})",
                request_id=rid, label=label,
            )
        try:
            self._transfer.check_remote(max(old_len, released), info.seq_len,
                                        self._remote_pages(info, page_size), remote)
        except KVRefError as err:
            # a misuse of this call, named as one: it changes nothing
            raise PublishedInfoError(str(err), request_id=rid, label=label) from err

    def _check_ready(self, rid: str, label: str) -> tuple[bool, AdmitRuntimeError | None]:
        """(ready, terminal failure). A failed retrieve is latched on the stream."""
        stream = self._table.streams[rid].get(label)
        if stream is None:
            return True, None
        state = admission.retrieve_state(stream)
        if state == admission.FAILED:
            err = stream.read_error
            return False, AdmitRuntimeError(
                f"KV retrieve failed: {type(err).__name__}: {err}", request_id=rid, label=label
            )
        return state == admission.IDLE, None
