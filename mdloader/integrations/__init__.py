"""Running other software on mdloader: DeePMD-kit's own trainer."""
