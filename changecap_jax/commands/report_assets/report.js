(function () {
  var gallery = document.getElementById("gallery");
  if (!gallery) { return; }
  var controls = document.getElementById("gallery-controls");
  var sortSel = document.getElementById("sort-select");
  var typeSel = document.getElementById("type-select");
  var counter = document.getElementById("shown-count");
  var cards = Array.prototype.slice.call(gallery.querySelectorAll("article.card"));
  var RANK = {cider_asc: "rankCiderAsc", cider_desc: "rankCiderDesc", image_id: "rankImageId"};
  function params() {
    var out = {};
    [location.search, location.hash].forEach(function (s) {
      s.replace(/^[?#]/, "").split("&").forEach(function (kv) {
        if (!kv) { return; }
        var i = kv.indexOf("=");
        var k = decodeURIComponent(i < 0 ? kv : kv.slice(0, i));
        out[k] = i < 0 ? "" : decodeURIComponent(kv.slice(i + 1).replace(/\+/g, " "));
      });
    });
    return out;
  }
  function hasOption(sel, value) {
    return !!sel && Array.prototype.some.call(sel.options, function (o) {
      return o.value === value;
    });
  }
  function apply() {
    var rank = RANK[sortSel.value] || RANK.cider_asc;
    var type = typeSel ? typeSel.value : "all";
    cards.sort(function (a, b) { return Number(a.dataset[rank]) - Number(b.dataset[rank]); });
    var shown = 0;
    cards.forEach(function (card) {
      var visible = type === "all" || card.dataset.type === type;
      card.hidden = !visible;
      if (visible) { shown += 1; }
      gallery.appendChild(card);
    });
    counter.textContent = "showing " + shown + " of " + cards.length;
    document.body.setAttribute("data-sort", sortSel.value);
  }
  function remember() {
    var frag = "#sort=" + sortSel.value;
    if (typeSel && typeSel.value !== "all") {
      frag += "&type=" + encodeURIComponent(typeSel.value);
    }
    try { history.replaceState(null, "", frag); } catch (e) { /* e.g. sandboxed file: URLs */ }
  }
  var p = params();
  if (hasOption(sortSel, p.sort)) { sortSel.value = p.sort; }
  if (hasOption(typeSel, p.type)) { typeSel.value = p.type; }
  controls.hidden = false;
  apply();
  sortSel.addEventListener("change", function () { apply(); remember(); });
  if (typeSel) { typeSel.addEventListener("change", function () { apply(); remember(); }); }
})();
