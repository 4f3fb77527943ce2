"""The MongoDB backend as the registry sees it: its :class:`Descriptor`."""

from __future__ import annotations

from ..._clock import Clock
from ..._options import Options
from ..abc import Descriptor
from ..shapes import Packages, method, refuse_other_face
from .names import check_collection_name, check_db_name
from .readwrite import MongoReadWriteStore
from .shapes import recognises
from .store import MongoStore
from .url import FORM

PACKAGES = Packages(sync=("pymongo",), asyncio=("pymongo.AsyncMongoClient",))


def _collection(client: object, options: Options, needed: str, asynchronous: bool) -> object:
    """The collection of ``options``, its names and face checked.

    No I/O: ``get_database`` and ``get_collection`` make no request.
    """
    check_db_name(options.db_name)
    check_collection_name(options.collection_name, options.collection_origin, options.db_name)
    database = method(client, "get_database")(options.db_name)
    collection = method(database, "get_collection")(options.collection_name)
    refuse_other_face(collection, needed, "collection", PACKAGES, asynchronous=asynchronous)
    return collection


def open_store(client: object, options: Options, clock: Clock, *, asynchronous: bool) -> MongoStore:
    """The collection of ``options``' mutexes or semaphores.

    Fencing only if asked (``fencing=True``): it costs one more request per grant here.
    """
    collection = _collection(client, options, "update_one", asynchronous)
    return MongoStore(collection, options.max_permits, clock, fencing=options.fencing is True)


def open_readwrite_store(
    client: object, options: Options, clock: Clock, *, asynchronous: bool
) -> MongoReadWriteStore:
    """The collection of ``options``' read-write locks."""
    collection = _collection(client, options, "find_one_and_update", asynchronous)
    fencing = options.fencing is not False
    return MongoReadWriteStore(collection, options.max_readers, clock, fencing=fencing)


BACKEND = Descriptor(
    name="mongodb",
    label="MongoDB",
    recognises=recognises,
    open_store=open_store,
    open_readwrite_store=open_readwrite_store,
    needs="get_database(name)",
    replicas=(
        "on MongoDB, give the collection the write concern locks need "
        "(w='majority', j=True); dmutex uses it as it is"
    ),
    url=FORM,
)
"""MongoDB (pymongo, motor, the MongoDB-compatible servers that speak its protocol)."""
