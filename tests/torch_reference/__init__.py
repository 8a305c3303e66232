"""What only the tests need beside the project's torch reference (changecap_jax/torch_reference):
the plain-PyTorch IDC-PCL re-implementation (idc_pcl.py), the official snapshot format
(snapshot.py) and a stand-in official checkout built on the reference (official_layout.py)."""
