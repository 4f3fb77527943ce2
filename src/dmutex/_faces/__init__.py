"""The public classes: the sync face (``sync.py``) and the asyncio face (``aio.py``).

Both are thin: a method checks nothing and decides nothing, it asks the engine
for an operation's steps and hands them to its driver (``drive.py``). A test
keeps the two faces' methods and signatures in step.
"""
