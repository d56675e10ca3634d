// Wrapper module: the module proxy answers no version list for sigs.k8s.io/lws, which
// `go install sigs.k8s.io/lws/cmd@vX` asks for; building the pinned version from here works.
module pdcluster.local/lws

go 1.26.0

require sigs.k8s.io/lws v0.9.0
