"""Peers that benchmarks/compare_peers.py measures metrale against, and the servers it starts.

    servers.py               a server subprocess (metrale serve, llama-server) on a free port
    build_llama_server.sh    llama.cpp's llama-server from the llama-cpp-python sdist, into llama.cpp/ (ignored)
"""
