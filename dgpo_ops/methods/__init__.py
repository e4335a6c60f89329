"""The method table (one row per method) and what derives from it: names, trainer fields, styles, the psi atlas.
"""
