"""API: what applications hold -- remote executors and workers across sessions, fleets and the
sync facade. The package face (``garcon_link``) re-exports its public names.
"""
