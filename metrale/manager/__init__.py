"""Many models in one server: a catalog of models on disk, each loaded on demand as its own engine (own scheduler,
KV pool and step loop) and unloaded when idle or when another needs the memory.

    catalog.py     the models a server answers for: --models DIR, --model NAME=PATH; their size on disk
    keep_alive.py  Ollama's keep_alive values ("5m", 300, 0, -1) as seconds
    budget.py      the memory budget: the default from the machine, a model's estimated resident bytes
    slot.py        one model's state: unloaded | loading | loaded, its engine, the requests holding it
    manager.py     ModelManager: resolve a name to a loaded engine (loading it, evicting the LRU idle model)
    exposition.py  one Prometheus exposition from several engines' (one HELP/TYPE per family)

The room sits between the server and the engine: it uses engines only through metrale.engine.protocol and is
given a factory that builds one; the server (metrale/server/managed.py) maps its errors onto HTTP.
"""
