"""The dyndepth application: demo, benchmarks and command line; the library never imports it."""
