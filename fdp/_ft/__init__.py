"""Training that survives lost replicas: torchft's Manager, LocalSGD and DiLoCo over trees."""
