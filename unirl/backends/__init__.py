"""Training engines. Each subpackage implements the same small interface; they are imported only
when a config names them, so `import unirl` needs neither engine installed."""
