"""The SQLite backend: leases as rows of one table in a file that the processes of one host share.

Layout (shared with the TypeScript dmutex's D1 store): table ``table_name``,
else ``table_prefix + service_name`` (``_dmutex_`` / ``_dsemaphore_``), with
columns ``"key" TEXT PRIMARY KEY, "value" TEXT NOT NULL, "expired_at"
INTEGER NOT NULL`` (epoch milliseconds) and the index
``f"{table}_expired_at_idx"`` on ``expired_at``. Slot ``i`` of lock ``k`` is
the row ``key = f"permit:{i}:{k}"``, ``value`` its token. dmutex adds one row
per fenced key, ``key = f"fence:{k}"``: the fence counter, in decimal, with
``expired_at`` at the largest INTEGER so that nothing takes it for a lease.

Read-write locks (dmutex's own layout; the TypeScript library has none) use
the same table schema, ``table_prefix`` ``_drwlock_``: lock ``k`` is the one
row ``key = f"rwlock:{k}"``, whose ``value`` is the key's whole state as
compact JSON, ``{"dmutex":"rwlock","w":W,"r":R,"i":I}`` in that order, no
whitespace, ASCII only: ``W`` the writer ``["<token>",<expiry ms>]`` or
``null``, ``R`` the readers ``{"<token>":<expiry ms>,...}`` and ``I`` the
waiting writers' intents ``{"<token>":<until ms>,...}``, each sorted by
token, with nothing expired kept. ``expired_at`` is the latest of those
times, so a cleanup that deletes expired rows never removes a live hold;
the row is deleted when the last hold and intent end. The fence row is the
mutex's, ``fence:{k}``.

The modules: ``statements.py`` (the SQL of one table, the fence row),
``backend.py`` (:class:`SQLiteBackend`: the file, its connections, the one
call each operation is), ``store.py`` (mutexes and semaphores) and
``readwrite.py`` (read-write locks).

The rules of this backend (each module names those it keeps):

1. Every operation is one call of :class:`SQLiteBackend` and one transaction:
   a grant, its fence and its token check commit together or not at all. A
   lone statement is its own transaction; several run in ``BEGIN IMMEDIATE``,
   which takes the file's write lock first, so two processes never both read
   a slot free and both take it.
2. A slot is taken by an upsert whose ``DO UPDATE`` applies only to a row
   that has expired or already holds the caller's token (a re-sent copy of
   an acquire), so a held row is never overwritten; the statement's change
   count is the token check. Release and extend match key, token and an
   expiry still in the future, so a holder whose lease ran out can neither
   remove nor prolong its successor's row.
3. Time is the instance's clock (the host's, unless a test passes one):
   every process that shares the file reads the same one. It is read in the
   call, inside the transaction: a call that waited for the file decides
   and stores expiries by the time it runs, not the time it was asked.
   Nothing deletes expired rows; the next acquire of the slot overwrites them.
4. A release wakes the retrying acquires that wait for its key through the
   same backend object (threads and tasks of this process), as
   InMemoryBackend does; a waiter registers in the call of its failed
   attempt, under the backend's lock, so no release falls between. Other
   processes send no signal: their waiters poll (``waiting.py``, rule 3),
   and a failed attempt learns when the first lease in its way ends.
5. The sync face calls SQLite in the caller's thread; the asyncio face in
   one worker thread per backend, never on the event loop: a busy file makes
   a call wait up to ``timeout``. One worker keeps the calls in order, so the
   release that undoes a cancelled acquire runs after that acquire.
6. A read-write lock's operation (:class:`SQLiteReadWriteStore`) is one
   ``BEGIN IMMEDIATE`` transaction, as rule 1's: it reads the key's row,
   asks ``dmutex._core.readwrite`` (which drops what has expired, and
   decides), and writes the state back, or deletes the row once nothing is
   held or intended; a grant moves the fence row in the same transaction.
   Nothing is written when the decision changed nothing (a refused reader,
   say). Time is rule 3's, read once per transaction.
7. The row ``rwlock:{k}`` is written only over the value the transaction
   read and checked as dmutex's (the ``"dmutex":"rwlock"`` mark and exactly
   the layout's fields and types), and inserted only where there was none.
   A row of that key holding anything else (another program's, or a later
   format, which would carry another mark or field) makes every operation
   on the key raise :class:`~dmutex.DMutexError` and change nothing; a
   renewal batch answers that error for that lease only. A foreign fence
   row makes every attempt to acquire raise, granted or not, since the
   decision needs the counter.
8. Waking is rule 4's: a release, and a writer's last attempt that
   withdrew its intent, wake this process's waiters of the key; a refused
   attempt registers its waiter and tells it when what stands in its way
   lapses at the latest (the refusal's ``clears_ms``), so that waiters in
   other processes poll no longer than that.
9. Listing the held keys (``keys``, for ``dmutex status``) is one call and
   one statement, a read: the mutex store's finds the distinct keys of
   active slot rows (slots 0 to ``max_permits`` - 1, as ``holders`` reads)
   with ``LIMIT``; the read-write store's reads the rows whose
   ``expired_at`` is ahead in key order and stops at the ``limit``-th that
   a writer or reader holds (a row left with an intent alone holds none).
"""

from __future__ import annotations

from .backend import SQLiteBackend
from .descriptor import BACKEND
from .readwrite import SQLiteReadWriteStore
from .statements import quote
from .store import SQLiteStore

__all__ = ["BACKEND", "SQLiteBackend", "SQLiteReadWriteStore", "SQLiteStore", "quote"]
