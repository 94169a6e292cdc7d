"""The whole stack as users run it: tensora up / serve / gateway / plan and the CLI as children, a browser."""
