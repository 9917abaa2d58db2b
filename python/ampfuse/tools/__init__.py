"""ampfuse's command-line tools (`python -m ampfuse demo|doctor|apex-alias`).

Nothing here is imported by `import ampfuse`: the tools sit above the library and use only its
public API (and, for the doctor, its op registry), so training code never pays for them.
"""
