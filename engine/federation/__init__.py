"""Transports that move a method's payloads between the server half and the site halves.

- :mod:`engine.federation.inprocess`: the simulation (every site in this process);
- :mod:`engine.federation.flower`: the network (Flower SuperLink, SuperNodes, ServerApp, ClientApp);
- :mod:`engine.federation.spec`, :mod:`engine.federation.config`, :mod:`engine.federation.checkpoint`,
  :mod:`engine.federation.events`: what both sides agree on, configuration files, checkpoints and
  progress events of the network federation.
"""
