"""The method table: one row per method (``table.py``), one file per method or family, and the views the rest
derives from it (``catalog.py``: names, parameters, test variants). Knows no framework and no figure.
"""
