"""The public classes: the sync face (``sync.py``) and the asyncio face (``aio.py``).

Both are thin: a method checks nothing and decides nothing, it asks the engine
for an operation's steps and hands them to its driver
(``dmutex._runtime.drivers``). A test keeps the two faces' methods and
signatures in step. The drivers and the renewers that the faces use sit one
room below, in ``dmutex._runtime``.
"""
