"""Deploy time: the cluster config, ``disagg launch`` (renderer, supervisor), Triton provisioning,
the router's process, the engine commands (build / generate / chat) and the deployment's client."""
