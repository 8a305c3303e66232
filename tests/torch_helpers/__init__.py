"""What only the tests need beside the PyTorch references of tools/torch_reference/: the
official snapshot format (snapshot.py) and a stand-in official checkout built on the
reference (official_layout.py)."""
