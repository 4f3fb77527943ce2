"""What the SQL stores share: SQLAlchemy engines, their shapes and protocols.

- ``engines.py``: SQLAlchemy engines lending their driver's connections;
- ``shapes.py``, ``clients.py``: what an engine looks like, as the SQL rooms accept it.

(The read-write state codec and the compare-and-set store, which the SQL
stores share with DynamoDB's, are ``_backends/rwstate.py`` and
``_backends/rwcas.py``.)
"""
