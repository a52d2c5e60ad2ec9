"""One declarative table per HF family; importing a module registers its classes."""
